"""Evaluations of stored policies, kept in DuckDB: computed once per policy version x protocol x problem
set (``eval_id``) and reused after that, so every number in a report can be re-derived with SQL.

An evaluation is computed under a file lock of its ``eval_id``, so a concurrent run waits and reuses
its rows. A row names its policy by its model-store name; the part it plays in a report (base, trained,
champion) is the report's. A policy is evaluated in the environment its checkpoint records, unless the
protocol names another.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import pandas as pd
from dagster import ConfigurableResource
from pydantic import Field

from resources.compute import ComputeResource
from resources.run_config import EnvironmentConfig, build_environment, config_from
from resources.warehouse import Warehouse
from rlvr.evaluation.runner import EvalConfig, evaluate_policy
from rlvr.policy import SINGLE_TURN, environment_spec, stored_environment
from rlvr.tasks import DEFAULT_TASK

PROGRESS_EVERY_S = 30


class EvalProtocol(config_from(EvalConfig, exclude=("top_p", "confidence"))):
    """The evaluation protocol: the same for the baseline and the trained policy, so they pair."""

    split: str = Field(default="test", description="held-out split of the task's problems")
    limit: Optional[int] = Field(default=50, description="first N problems of the split (None: all)")
    environment: Optional[EnvironmentConfig] = Field(
        default=None, description="the environment every policy is evaluated in, e.g. {name: calculator}; unset: each policy's own (its lineage)"
    )

    def environment_of(self, path: Path) -> dict:
        """The environment spec a policy (checkpoint at ``path``) is evaluated in: this protocol's, else the one it records."""
        return self.environment.spec() if self.environment is not None else stored_environment(path)


@dataclass(frozen=True)
class Evaluation:
    """Per-problem results of one policy under one protocol."""

    eval_id: str
    results: list[dict]
    reused: bool  # read from eval_results rather than computed now
    environment: dict = field(default_factory=lambda: dict(SINGLE_TURN))  # the spec it ran in ({"name", "options"})

    @property
    def correct(self) -> list[bool]:
        """Strict correctness per problem: what promotion decisions compare."""
        return [bool(r["correct_strict"]) for r in self.results]


def eval_id(policy_version: str, protocol: EvalProtocol, problems: list[dict], environment: dict | None = None) -> str:
    """Identity of one evaluation: what was evaluated, how, in which environment (a single-turn one
    leaves the key as it was before environments) and on which engine (the default leaves it as it was
    before engines), on which problems."""
    how = protocol.model_dump(exclude={"environment", "engine"})
    if protocol.engine is not None and protocol.engine.model_dump() != type(protocol.engine)().model_dump():
        how["engine"] = protocol.engine.model_dump()
    if environment is not None and environment["name"] != SINGLE_TURN["name"]:
        how["environment"] = environment
    key = json.dumps({"policy": policy_version, "protocol": how, "problems": [p["content_hash"] for p in problems]}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class Evaluator(ConfigurableResource):
    """Evaluates stored policies with the core runner on the compute resource; rows in ``eval_results``."""

    warehouse: Warehouse
    compute: ComputeResource

    def evaluate(
        self, policy: str, policy_version: str, path: Path, protocol: EvalProtocol, problems: list[dict], log=None, reuse: bool = True, task=None
    ) -> Evaluation:
        """``policy_version`` of the stored ``policy`` (its model-store name; checkpoint at ``path``) under
        ``protocol``, in the policy's environment (``EvalProtocol.environment_of``): from ``eval_results``
        when stored (unless ``reuse`` is off), else computed now and stored, replacing the stored rows.
        Another process computing the same evaluation is waited for. A ValueError names an environment
        that cannot be built. ``task`` (``rlvr.tasks``; None: GSM8k) grades the problems; its name is on every row."""
        environment = build_environment(protocol.environment_of(path), f"{policy} {policy_version}")
        spec = environment_spec(environment)
        key = eval_id(policy_version, protocol, problems, spec)
        with self.computing(key, log):
            stored = self.warehouse.eval_results(key) if reuse else None
            if stored is not None and len(stored) == len(problems):
                if log:
                    log.info(f"{policy}: reusing stored evaluation {key} of {policy_version}")
                return Evaluation(key, stored.to_dict(orient="records"), True, spec)
            model, tokenizer = self.compute.inference_policy(path)
            if log and spec["name"] != SINGLE_TURN["name"]:
                log.info(f"{policy}: evaluating {policy_version} in its environment {spec}")
            results = evaluate_policy(model, tokenizer, problems, protocol.to_core(), _progress_logger(policy, log), environment, task)
            frame = pd.DataFrame(results).assign(
                task=task.name if task is not None else DEFAULT_TASK,
                eval_id=key,
                policy_role=policy,
                policy_version=policy_version,
                split=protocol.split,
                evaluated_at=pd.Timestamp.now(tz="UTC"),
            )
            self.warehouse.upsert("eval_results", frame, key="eval_id")
        return Evaluation(key, frame.to_dict(orient="records"), False, spec)

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


def _progress_logger(policy: str, log):
    """A progress callback logging completions done at most every PROGRESS_EVERY_S seconds, and at the end."""
    started, last = time.perf_counter(), [0.0]

    def progress(done: int, total: int) -> None:
        if log and (done == total or time.perf_counter() - last[0] > PROGRESS_EVERY_S):
            last[0] = time.perf_counter()
            log.info(f"{policy}: {done}/{total} completions ({time.perf_counter() - started:.0f} s)")

    return progress
