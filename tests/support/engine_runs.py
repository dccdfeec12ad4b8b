"""Driving the generation engine step by step, and watching what each of its forwards sees."""

from __future__ import annotations

from typing import Callable

import torch

from rlvr.generation import Engine, EngineRequest


def run_engine(engine: Engine, arrivals: dict[int, list[EngineRequest]], max_steps: int = 500) -> list[int]:
    """Submit each step's arrivals before it, step until every request is done; the rows per step."""
    requests = [q for qs in arrivals.values() for q in qs]
    rows = []
    for step in range(max_steps):
        for request in arrivals.get(step, []):
            engine.submit(request)
        engine.take_submissions()
        engine.step()
        rows.append(len(engine.rows))
        assert engine.kv_bytes() <= engine.kv_budget_bytes
        if all(q.done_s is not None for q in requests) and step >= max(arrivals):
            return rows
    raise AssertionError("the engine did not finish")


def watch_forwards(engine: Engine, seen: Callable[[torch.Tensor], None]) -> None:
    """Show ``seen`` the tokens of each of the engine's forwards (before it runs)."""
    forward = engine.executor.runner.forward

    def watched(tokens, positions, attend, logits_at=None):
        seen(tokens)
        return forward(tokens, positions, attend, logits_at)

    engine.executor.runner = type("Watched", (), {"forward": staticmethod(watched)})()
