"""Figures for the Dagster UI: PNGs embedded in Markdown metadata (and saved for MLflow where asked)."""

from __future__ import annotations

import base64
import io
from typing import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def figure_markdown(fig, title: str) -> str:
    """Render a matplotlib figure as Markdown with the PNG inlined, then close it."""
    return f"![{title}](data:image/png;base64,{base64.b64encode(figure_png(fig)).decode()})"


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
