"""Figures for reports and the Dagster UI: matplotlib figures as PNG bytes, or PNGs inlined in Markdown."""

from __future__ import annotations

import base64
import io
from typing import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator, PercentFormatter  # noqa: E402


def figure_markdown(fig, title: str) -> str:
    """Render a matplotlib figure as Markdown with the PNG inlined, then close it."""
    return png_markdown(figure_png(fig), title)


def png_markdown(png: bytes, title: str) -> str:
    """Markdown showing PNG bytes inline (the Dagster UI renders it in asset metadata)."""
    return f"![{title}](data:image/png;base64,{base64.b64encode(png).decode()})"


def figure_png(fig) -> bytes:
    """PNG bytes of a matplotlib figure; the figure is closed."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()


def histogram_figure(values: Iterable[float], title: str, discrete: bool = False):
    values = list(values)
    fig, ax = plt.subplots(figsize=(5, 2.6))
    if discrete and values:
        low, high = int(min(values)), int(max(values))
        ax.hist(values, bins=[x - 0.5 for x in range(low, high + 2)], color="#4c72b0")
    else:
        ax.hist(values, bins=30, color="#4c72b0")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("count")
    return fig


def histogram_markdown(values: Iterable[float], title: str, discrete: bool = False) -> str:
    return figure_markdown(histogram_figure(values, title, discrete), title)


def accuracy_figure(rows: list[tuple[str, float, float, float]], title: str = "pass@1 (strict) with 95% CI"):
    """Bars of accuracy per policy with confidence-interval error bars: rows of (label, value, low, high).
    Each percentage sits above its bar's upper error bar, so the two never overlap."""
    fig, ax = plt.subplots(figsize=(5, 2.8))
    labels = [r[0] for r in rows]
    values = [r[1] for r in rows]
    errors = [[max(0.0, r[1] - r[2]) for r in rows], [max(0.0, r[3] - r[1]) for r in rows]]
    ax.bar(labels, values, yerr=errors, capsize=6, color=["#8c8c8c", "#4c72b0", "#55a868"][: len(rows)])
    top = max(0.05, max(max(r[1], r[3]) for r in rows) * 1.3)
    for x, (_, value, _, high) in enumerate(rows):
        ax.text(x, max(value, high) + top * 0.03, f"{value:.1%}", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, top)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title(title, fontsize=10)
    return fig


def overlaid_histograms_figure(series: dict[str, list[float]], title: str, bins: int = 20):
    """Histograms of several samples on one axis (e.g. reward of base vs trained completions)."""
    fig, ax = plt.subplots(figsize=(5, 2.8))
    for label, values in series.items():
        ax.hist(values, bins=bins, range=(0, 1), alpha=0.55, label=label)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("completions")
    ax.legend(fontsize=8)
    return fig


def grouped_accuracy_figure(tables: dict[str, list[dict]], title: str = "accuracy by reasoning steps"):
    """Accuracy with Wilson CIs per group for several policies; tables are ``accuracy_by_group`` records."""
    fig, ax = plt.subplots(figsize=(5, 2.8))
    width = 0.8 / max(1, len(tables))
    for i, (label, rows) in enumerate(tables.items()):
        xs = [r["group"] + (i - (len(tables) - 1) / 2) * width for r in rows]
        ys = [r["accuracy"] for r in rows]
        errors = [[max(0.0, r["accuracy"] - r["ci_low"]) for r in rows], [max(0.0, r["ci_high"] - r["accuracy"]) for r in rows]]
        ax.bar(xs, ys, width=width, yerr=errors, capsize=2, label=label)
    ax.set_xlabel("reference reasoning steps")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylabel("accuracy")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def curves_figure(curves: dict[str, list[tuple[int, float]]], title: str = "training curves", own_axis: tuple[str, ...] = ("loss",)):
    """One line per metric over training steps: curves of (step, value). A metric whose name holds one
    of ``own_axis`` (the loss, about 1e-6, beside rewards in [0, 1]) is drawn in a panel of its own below."""
    drawn = {label: points for label, points in curves.items() if points}
    apart = [label for label in drawn if any(word in label for word in own_axis)]
    panels = [[label for label in drawn if label not in apart], apart]
    panels = [panel for panel in panels if panel] or [[]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(5, 2.8 if len(panels) == 1 else 4.2), sharex=True, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        for label in panel:
            ax.plot([p[0] for p in drawn[label]], [p[1] for p in drawn[label]], marker=".", label=label)
        if panel:
            ax.legend(fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axes[0, 0].set_title(title, fontsize=10)
    axes[-1, 0].set_xlabel("step")
    return fig


def task_comparison_figure(rows: list[dict], title: str = "pass@1 per task, base vs trained (95% CI)"):
    """Grouped bars per task (and the macro average): base and trained pass@1 with their CIs; ``rows``
    are the cross-task table's (``task``, ``base``, ``base_ci_low``, ..., ``trained_ci_high``)."""
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(rows)), 3))
    for offset, name, shade in ((-0.2, "base", "#8c8c8c"), (0.2, "trained", "#4c72b0")):
        values = [r[name] for r in rows]
        errors = [[max(0.0, r[name] - r[f"{name}_ci_low"]) for r in rows], [max(0.0, r[f"{name}_ci_high"] - r[name]) for r in rows]]
        ax.bar([x + offset for x in range(len(rows))], values, width=0.4, yerr=errors, capsize=3, color=shade, label=name)
    ax.set_xticks(range(len(rows)), [r["task"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def bars_figure(labels: list[str], values: list[float], title: str, ylabel: str):
    """One bar per label (a cost by asset, task or API key); a figure saying "none yet" when there are none."""
    fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(labels)), 2.8))
    if labels:
        ax.bar(range(len(labels)), values, color="#4c72b0")
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "none yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    return fig


def daily_figure(days: list[str], series: dict[str, list[float]], title: str, ylabel: str):
    """Lines over days (``YYYY-MM-DD``), one per series (e.g. training and serving cost per day)."""
    fig, ax = plt.subplots(figsize=(5, 2.8))
    for label, values in series.items():
        ax.plot(days, values, marker=".", label=label)
    if not days:
        ax.text(0.5, 0.5, "none yet", ha="center", va="center", transform=ax.transAxes)
    elif len(series) > 1:
        ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    return fig
