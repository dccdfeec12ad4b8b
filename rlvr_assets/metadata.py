"""Asset metadata a person reads: rates as percentages, other numbers to three significant digits,
whole numbers whole, a blank where a value does not apply, and many numbers in one table."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from dagster import MetadataValue

RATE_PREFIXES = ("pass@", "maj@", "accuracy", "format_compliance", "format_delta", "delta", "frac_", "clip_frac", "ci_")


def is_rate(name: str) -> bool:
    """Whether the metric ``name`` is a fraction in [0, 1] (of problems, completions, groups): shown as a percentage."""
    base = name.rsplit(".", 1)[-1].removeprefix("final_").removesuffix("_ci_low").removesuffix("_ci_high")
    return base.startswith(RATE_PREFIXES) or base.endswith("_rate")


def rounded(value: float, digits: int = 3) -> float:
    """``value`` to ``digits`` significant digits; float noise (``2.8e-17``) is 0."""
    return 0.0 if abs(value) < 1e-12 else float(f"{value:.{digits}g}")


def amount(value: float) -> float:
    """A small amount (USD, Wh) as a person reads it: three significant digits, at most four decimals."""
    return round(rounded(value), 4) + 0.0


def percent(rate: float) -> float:
    """A rate as a percentage with one decimal (a number, so Dagster plots it across materializations)."""
    return round(100 * rate, 1) + 0.0  # + 0.0: no -0.0


def readable(name: str, value: Any) -> str:
    """One value as text: a rate as ``12.3%`` (signed when ``name`` is a delta), a whole number whole,
    another number to three significant digits, '' where it does not apply (None, NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, (int, float)):
        return str(value)
    if is_rate(name):
        return f"{100 * value:{'+' if 'delta' in name else ''}.1f}%".replace("-0.0%", "0.0%").replace("+0.0%", "0.0%")
    if float(value).is_integer():
        return str(int(value))
    return f"{rounded(value):g}"


def markdown_table(rows: Sequence[Mapping[str, Any]], labels: Mapping[str, str] | None = None) -> MetadataValue:
    """Rows of named values as one Markdown table, each cell :func:`readable` by its column's name;
    ``labels`` renames columns for the header."""
    columns = list(dict.fromkeys(name for row in rows for name in row))
    header = [(labels or {}).get(c, c) for c in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(readable(c, row.get(c)) for c in columns) + " |" for row in rows]
    return MetadataValue.md("\n".join(lines))


def metrics_table(columns: Mapping[str, Mapping[str, Any]]) -> MetadataValue:
    """Many metrics in one table: a row per metric, a column per source (e.g. ``base``, ``trained``)."""
    names = list(dict.fromkeys(name for metrics in columns.values() for name in metrics))
    rows = [{"metric": name, **{source: _cell(name, metrics.get(name)) for source, metrics in columns.items()}} for name in names]
    return markdown_table(rows)


def _cell(name: str, value: Any) -> str:
    return readable(name, value) or "–"


def evaluation_headline(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers an evaluation is read by (``summarize``'s metrics): pass@1 strict and flexible and
    format compliance as percentages, and the number of problems."""
    return {
        "pass@1 strict (%)": percent(metrics["pass@1_strict"]),
        "pass@1 flexible (%)": percent(metrics["pass@1_flexible"]),
        "format compliance (%)": percent(metrics["format_compliance"]),
        "problems": int(metrics["num_problems"]),
    }


def policy_cost_metadata(cost, gain_points: float) -> dict[str, Any]:
    """What training the evaluated policy cost (``resources.costs.PolicyCost``, None when its run recorded no step
    costs) and that cost per point of pass@1 gained over the base; USD only where priced."""
    if cost is None:
        return {"training cost": "no step costs recorded for the trained policy's run"}
    found = {"training cost: CPU core-s": rounded(cost.total.cpu_core_s), "training cost: GPU-s": rounded(cost.total.gpu_s)}
    found["training CPU core-s per point gained"] = _per_point(cost.total.cpu_core_s, gain_points)
    if cost.money is not None:
        found |= {"training cost (USD)": amount(cost.money), "training USD per point gained": _per_point(cost.money, gain_points)}
    return found


def task_cost_rows(cost, gains_points: Mapping[str, float]) -> list[dict[str, Any]]:
    """Per task: its share of the training cost (by its share of the step rows' tokens) and that per point gained."""
    rows = []
    for task, gain in gains_points.items():
        usage, money = cost.per_task.get(task, (None, None))
        core_s = usage.cpu_core_s if usage is not None else 0.0
        row = {"task": task, "Δ (points)": gain, "CPU core-s": rounded(core_s), "core-s per point": _per_point(core_s, gain)}
        if cost.money is not None:
            row |= {"USD": amount(money or 0.0), "USD per point": _per_point(money or 0.0, gain)}
        rows.append(row)
    return rows


def _per_point(spent: float, gain_points: float) -> float | str:
    return amount(spent / gain_points) if gain_points > 0 else "no gain"
