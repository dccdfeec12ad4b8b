"""Cheap surface features of math word problems, compared between training data and serving traffic."""

from __future__ import annotations

import math
import re
from typing import Iterable

import pandas as pd

PROMPT_FEATURES = (
    "num_chars",
    "num_words",
    "num_numbers",
    "max_log10_number",
    "mean_log10_number",
    "num_sentences",
)

_NUMBER_RE = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")
_SENTENCE_END_RE = re.compile(r"[.!?]+(?=\s|$)")


def prompt_features(texts: Iterable[str]) -> pd.DataFrame:
    """One row of features per question text, columns as in ``PROMPT_FEATURES``.

    * ``num_chars``, ``num_words`` (whitespace-separated tokens);
    * ``num_numbers``: numbers written with digits (``1,200``, ``3.5``; ``3/4`` counts as two);
    * ``max_log10_number``, ``mean_log10_number``: of log10(1 + |x|) over those numbers, 0 when
      there are none;
    * ``num_sentences``: runs of text ended by ``.``, ``!`` or ``?`` (a decimal point does not end
      one), a proxy for the number of reasoning steps along with ``num_numbers``.
    """
    return pd.DataFrame([_features(text) for text in texts], columns=list(PROMPT_FEATURES))


def _features(text: str) -> dict[str, float]:
    magnitudes = [math.log10(1 + float(m.group(0).replace(",", ""))) for m in _NUMBER_RE.finditer(text)]
    stripped = text.strip()
    sentences = len(_SENTENCE_END_RE.findall(stripped))
    if stripped and stripped[-1] not in ".!?":
        sentences += 1  # a last sentence without final punctuation
    return {
        "num_chars": len(text),
        "num_words": len(text.split()),
        "num_numbers": len(magnitudes),
        "max_log10_number": max(magnitudes, default=0.0),
        "mean_log10_number": sum(magnitudes) / len(magnitudes) if magnitudes else 0.0,
        "num_sentences": sentences,
    }
