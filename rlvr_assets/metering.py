"""``@metered``: every materialization's cost in the ledger (``costs``, scope ``asset``) and in its metadata.

Put under ``@asset`` / ``@multi_asset``. The materialization is measured with :class:`~rlvr.costs.UsageMeter`
(this process and the ones it starts: torchrun ranks, reward workers) and one row is written through the
asset's :class:`~resources.Warehouse` (its own parameter, else its evaluator's), also when the asset
fails. An asset body adds what only it knows with :func:`count_evaluation`
(tokens of an evaluation on a task: a row of scope ``evaluation`` per task) and logs :func:`cost_metrics` to MLflow.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass, field
from typing import Iterator

from dagster import AssetExecutionContext, MaterializeResult

from resources import Evaluation, Upsert, Warehouse
from resources.costs import COSTS, cost_frame, cost_row
from rlvr.costs import Usage, UsageMeter, configured_prices, machine_kind
from rlvr_assets.metadata import amount

_ACTIVE: contextvars.ContextVar["AssetCost | None"] = contextvars.ContextVar("rlvr_asset_cost", default=None)


@dataclass
class AssetCost:
    """One materialization being measured: its meter, its attribution and the evaluations it counted."""

    meter: UsageMeter
    asset: str
    partition: str
    run_id: str
    root_run_id: str
    machine: str
    evaluations: dict[str, Usage] = field(default_factory=dict)  # task -> its evaluations' tokens
    final: Usage = field(default_factory=Usage)  # what was recorded when the materialization ended
    trained: Usage = field(default_factory=Usage)  # the tokens of the training steps it ran (count_training)

    def usage(self) -> Usage:
        """What the materialization used so far, with its evaluations' and its training's tokens."""
        tokens = sum(self.evaluations.values(), self.trained)
        return self.meter.read().with_tokens(tokens.prompt_tokens, tokens.completion_tokens, tokens.trained_tokens)

    def rows(self, usage: Usage) -> list[dict]:
        """The asset's row and, per evaluated task, an ``evaluation`` row: the usage's share by the task's tokens."""
        ids = {"run_id": self.run_id, "root_run_id": self.root_run_id, "asset": self.asset, "partition": self.partition, "machine": self.machine}
        rows = [cost_row(usage, scope="asset", **ids)]
        tokens = {task: t.prompt_tokens + t.completion_tokens for task, t in self.evaluations.items()}
        for task, counted in self.evaluations.items():
            share = tokens[task] / sum(tokens.values()) if sum(tokens.values()) else 1 / len(tokens)
            task_usage = usage.share(share).with_tokens(counted.prompt_tokens, counted.completion_tokens)
            rows.append(cost_row(task_usage, scope="evaluation", task=task, **ids))
        return rows


def count_training(prompt: int, completion: int, trained: int) -> None:
    """Count a training's tokens (its steps' prompt, completion and trained tokens) in the running materialization's cost."""
    cost = _ACTIVE.get()
    if cost is not None:
        cost.trained = cost.trained + Usage().with_tokens(prompt, completion, trained)


def count_evaluation(task: str, *evaluations: Evaluation) -> None:
    """Count evaluations' tokens on ``task`` (their results' ``prompt_tokens`` / ``completion_tokens`` where they
    have them) in the running materialization's cost; a reused evaluation did no work and counts none."""
    cost = _ACTIVE.get()
    if cost is None or all(evaluation.reused for evaluation in evaluations):
        return
    results = [r for evaluation in evaluations if not evaluation.reused for r in evaluation.results]
    counted = Usage().with_tokens(sum(int(r.get("prompt_tokens") or 0) for r in results), sum(int(r.get("completion_tokens") or 0) for r in results))
    cost.evaluations[task] = cost.evaluations.get(task, Usage()) + counted


def cost_metadata(usage: Usage, machine: str) -> dict:
    """A usage as metadata: wall, core-seconds, GPU-seconds, peak memory, energy (marked when estimated), tokens, and
    USD only when a price is set."""
    estimated = " (estimated)" if "estimate" in usage.energy_source else ""
    found = {
        "cost: wall (s)": round(usage.wall_s, 2),
        "cost: CPU core-s": round(usage.cpu_core_s, 2),
        "cost: peak RSS (MiB)": round(usage.peak_rss_mb, 1),
        f"cost: energy (Wh){estimated}": amount(usage.energy_kwh * 1000),
    }
    if usage.gpu_s:
        found |= {"cost: GPU-s": round(usage.gpu_s, 2), "cost: peak GPU memory (MiB)": round(usage.peak_gpu_mem_mb, 1)}
    if usage.prompt_tokens or usage.completion_tokens:
        found |= {"cost: prompt tokens": usage.prompt_tokens, "cost: completion tokens": usage.completion_tokens}
    money = configured_prices().money(usage, machine)
    return found | ({"cost (USD)": amount(money)} if money is not None else {})


def metered(fn):
    """Measure each materialization of the asset ``fn`` computes (see the module docstring); a TypeError when ``fn``
    takes neither a ``duckdb`` warehouse nor an ``evaluator``, which the cost row is written through."""
    if not {"duckdb", "evaluator"} & set(inspect.signature(fn).parameters):
        raise TypeError(f"metered asset {fn.__name__} takes no Warehouse resource (duckdb) to write its cost row through")
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def measured_events(context: AssetExecutionContext, *args, **kwargs):
            pending = None  # a MaterializeResult is held until the next event (or the end), so the last one carries the total
            with measuring(context, kwargs) as cost:
                for event in fn(context, *args, **kwargs):
                    if pending is not None:
                        yield _with_cost(pending, cost.usage(), cost.machine)
                        pending = None
                    if isinstance(event, MaterializeResult):
                        pending = event
                    else:
                        yield event
            if pending is not None:
                yield _with_cost(pending, cost.final, cost.machine)

        return measured_events

    @functools.wraps(fn)
    def measured(context: AssetExecutionContext, *args, **kwargs):
        with measuring(context, kwargs) as cost:
            result = fn(context, *args, **kwargs)
        return _with_cost(result, cost.final, cost.machine) if isinstance(result, MaterializeResult) else result

    return measured


@contextlib.contextmanager
def measuring(context: AssetExecutionContext, resources: dict) -> Iterator[AssetCost]:
    """The materialization's :class:`AssetCost` while the block runs; its row written when the block ends, also
    when it raises (the work was spent). ``cost.final``: the usage recorded."""
    cost = _open(context)
    token = _ACTIVE.set(cost)
    try:
        with cost.meter:
            try:
                yield cost
            finally:
                cost.final = cost.usage()
    finally:
        _ACTIVE.reset(token)
        _record(warehouse_of(resources), cost, cost.final)


def _open(context: AssetExecutionContext) -> AssetCost:
    keys = context.assets_def.keys
    asset = next(iter(keys)).to_user_string() if len(keys) == 1 else context.op_def.name
    partition = str(context.partition_key) if context.has_partition_key else ""
    run = context.run
    return AssetCost(UsageMeter(), asset, partition, run.run_id, run.root_run_id or run.run_id, machine_kind())


def _with_cost(result: MaterializeResult, usage: Usage, machine: str) -> MaterializeResult:
    return result._replace(metadata={**(result.metadata or {}), **cost_metadata(usage, machine)})


def _record(warehouse: Warehouse, cost: AssetCost, usage: Usage) -> None:
    warehouse.write(Upsert(COSTS, cost_frame(cost.rows(usage)), "cost_id"))


def warehouse_of(resources: dict) -> Warehouse:
    """The warehouse among a metered asset's resources: a Warehouse, else its evaluator's; a TypeError without one."""
    for value in resources.values():
        if isinstance(value, Warehouse):
            return value
    for value in resources.values():
        if isinstance(getattr(value, "warehouse", None), Warehouse):
            return value.warehouse
    raise TypeError(f"a metered asset takes a Warehouse resource (duckdb) for its cost row; its resources: {sorted(resources)}")


def cost_metrics() -> dict[str, float]:
    """The running materialization's cost so far as MLflow metrics (``cost/<measure>``, ``cost/usd`` where priced)."""
    cost = _ACTIVE.get()
    if cost is None:
        return {}
    usage = cost.usage()
    metrics = {f"cost/{name}": float(getattr(usage, name)) for name in ("wall_s", "cpu_core_s", "gpu_s", "energy_kwh", "prompt_tokens", "completion_tokens")}
    money = configured_prices().money(usage, cost.machine)
    return metrics | ({"cost/usd": money} if money is not None else {})
