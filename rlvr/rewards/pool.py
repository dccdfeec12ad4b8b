"""Score a batch of completions on worker threads, so one slow verifier cannot stall the trainer.

Each (sample, reward) job runs on its own daemon thread, at most ``workers`` at a time. A job
still running ``timeout_s`` after it started scores 0 with an error and gives up its slot; its
thread is abandoned (Python threads cannot be killed). Threads suffice: code execution waits on
its own sandboxed subprocess, which has its own time limits.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Mapping, Sequence

from rlvr.rewards.composite import CompositeReward
from rlvr.rewards.registry import TOTAL, RewardResult, score


class RewardPool:
    """Context manager scoring batches: ``pool.score_batch(weights, completions, references)``."""

    def __init__(self, workers: int = 2, timeout_s: float = 30.0):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.workers = workers
        self.timeout_s = timeout_s
        self.abandoned = 0  # jobs given up on after timeout_s (their threads may still be running)
        self._closed = False

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True

    def score_batch(self, reward_weights: Mapping[str, float], completions: Sequence[str],
                    references: Sequence[Mapping]) -> list[dict[str, RewardResult]]:
        """One dict per completion, in input order: each reward's result plus ``"total"``, their weighted mean."""
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        if len(completions) != len(references):
            raise ValueError(f"{len(completions)} completions but {len(references)} references")
        composite = CompositeReward(reward_weights)
        jobs = [(i, name) for i in range(len(completions)) for name in composite.weights]
        finished: queue.SimpleQueue = queue.SimpleQueue()
        running: dict[tuple[int, str], float] = {}  # job -> start time
        results: dict[tuple[int, str], RewardResult] = {}
        pending = iter(jobs)
        while len(results) < len(jobs):
            while len(running) < self.workers and (job := next(pending, None)) is not None:
                running[job] = time.monotonic()
                threading.Thread(target=_run_job, args=(job, completions, references, finished),
                                 name=f"reward-{job[1]}-{job[0]}", daemon=True).start()
            wait_s = min(running.values()) + self.timeout_s - time.monotonic()
            try:
                job, result = finished.get(timeout=max(wait_s, 0.0))
                if running.pop(job, None) is not None:  # ignore late results of abandoned jobs
                    results[job] = result
            except queue.Empty:
                now = time.monotonic()
                for job, started in list(running.items()):
                    if now - started >= self.timeout_s:
                        del running[job]
                        self.abandoned += 1
                        results[job] = RewardResult(0.0, {"error": f"reward {job[1]!r} timed out after "
                                                                   f"{self.timeout_s:g} s on sample {job[0]}"})
        batch = []
        for i in range(len(completions)):
            components = {name: results[(i, name)] for name in composite.weights}
            batch.append({**components, TOTAL: composite.combine(components)})
        return batch


    def reward_fn(self, reward_weights: Mapping[str, float]):
        """The trainer's reward callback: ``(completions, problems) -> (totals, {name: values})``."""
        CompositeReward(reward_weights)  # validate names and weights now, not at the first step

        def rewards(completions: Sequence[str], problems: Sequence[Mapping]) -> tuple[list[float], dict[str, list[float]]]:
            batch = self.score_batch(reward_weights, completions, problems)
            return [b[TOTAL].value for b in batch], {name: [b[name].value for b in batch] for name in reward_weights}

        return rewards


def _run_job(job, completions, references, finished: queue.SimpleQueue) -> None:
    i, name = job
    try:
        result = score(name, completions[i], sample=i, **references[i])
    except Exception as err:  # noqa: BLE001 - e.g. a reference that is not a mapping
        result = RewardResult(0.0, {"error": f"reward {name!r} failed on sample {i}: {type(err).__name__}: {err}"})
    finished.put((job, result))
