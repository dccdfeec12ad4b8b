"""Evaluations of stored policies, kept in DuckDB: computed once per policy version x protocol x problem
set (``eval_id``) and reused after that, so every number in a report can be re-derived with SQL.

Once also across processes: an evaluation is computed under a lock of its ``eval_id`` (a file beside
the DuckDB file), so a second request of it, from another run, waits for the first and reuses its
rows. A row names its policy by its model-store name (``base_policy``, ``sft_policy``,
``grpo_checkpoint``), a property of the policy; the part a policy plays in a report (base, trained,
champion) is the report's."""

from __future__ import annotations

import fcntl
import hashlib
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pandas as pd
from dagster import ConfigurableResource
from pydantic import Field

from resources.compute import ComputeResource
from resources.run_config import config_from
from resources.warehouse import Warehouse
from rlvr.evaluation.runner import EvalConfig, evaluate_policy

PROGRESS_EVERY_S = 30


class EvalProtocol(config_from(EvalConfig, exclude=("top_p", "confidence"))):
    """The evaluation protocol: the same for the baseline and the trained policy, so they pair."""

    split: str = Field(default="test", description="held-out split of gsm8k_problems")
    limit: Optional[int] = Field(default=50, description="first N problems of the split (None: all)")


@dataclass(frozen=True)
class Evaluation:
    """Per-problem results of one policy under one protocol."""

    eval_id: str
    results: list[dict]
    reused: bool  # read from eval_results rather than computed now

    @property
    def correct(self) -> list[bool]:
        """Strict correctness per problem: what promotion decisions compare."""
        return [bool(r["correct_strict"]) for r in self.results]


def eval_id(policy_version: str, protocol: EvalProtocol, problems: list[dict]) -> str:
    """Identity of one evaluation: what was evaluated, how, on which problems."""
    key = json.dumps(
        {"policy": policy_version, "protocol": protocol.model_dump(), "problems": [p["content_hash"] for p in problems]},
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class Evaluator(ConfigurableResource):
    """Evaluates stored policies with the core runner on the compute resource; rows in ``eval_results``."""

    warehouse: Warehouse
    compute: ComputeResource

    def evaluate(self, policy: str, policy_version: str, path: Path, protocol: EvalProtocol, problems: list[dict], log=None, reuse: bool = True) -> Evaluation:
        """``policy_version`` of the stored ``policy`` (its model-store name; checkpoint at ``path``) under
        ``protocol``: from ``eval_results`` when stored (unless ``reuse`` is off), else computed now and
        stored, replacing the stored rows. Another process computing the same evaluation is waited for."""
        key = eval_id(policy_version, protocol, problems)
        with self.computing(key, log):
            stored = self.warehouse.eval_results(key) if reuse else None
            if stored is not None and len(stored) == len(problems):
                if log:
                    log.info(f"{policy}: reusing stored evaluation {key} of {policy_version}")
                return Evaluation(key, stored.to_dict(orient="records"), True)
            model, tokenizer = self.compute.inference_policy(path)
            results = evaluate_policy(model, tokenizer, problems, protocol.to_core(), _progress(policy, log))
            frame = pd.DataFrame(results).assign(
                eval_id=key,
                policy_role=policy,
                policy_version=policy_version,
                split=protocol.split,
                evaluated_at=pd.Timestamp.now(tz="UTC"),
            )
            self.warehouse.upsert("eval_results", frame, key="eval_id")
        return Evaluation(key, frame.to_dict(orient="records"), False)

    @contextmanager
    def computing(self, key: str, log=None) -> Iterator[None]:
        """Hold evaluation ``key``'s lock (``.eval-locks/<key>.lock`` beside the DuckDB file), waiting while another process holds it."""
        folder = Path(self.warehouse.database).resolve().parent / ".eval-locks"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{key}.lock", "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if log:
                    log.info(f"evaluation {key} is being computed by another run: waiting for it")
                fcntl.flock(handle, fcntl.LOCK_EX)
            yield


def _progress(policy: str, log):
    """A progress callback logging completions done at most every PROGRESS_EVERY_S seconds, and at the end."""
    started, last = time.perf_counter(), [0.0]

    def progress(done: int, total: int) -> None:
        if log and (done == total or time.perf_counter() - last[0] > PROGRESS_EVERY_S):
            last[0] = time.perf_counter()
            log.info(f"{policy}: {done}/{total} completions ({time.perf_counter() - started:.0f} s)")

    return progress
