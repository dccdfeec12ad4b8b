"""Rewards on text: ``format``, ``exact_match``, ``token_f1``, ``classification``, ``regression``."""

from __future__ import annotations

import math
import numbers
import re
import string
from collections import Counter
from typing import Callable, Sequence

from rlvr.answers import extract_final_answer, is_well_formed, normalize_answer, parse_number
from rlvr.rewards.registry import RewardResult, register_reward

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b", re.IGNORECASE)

NORMALIZERS: dict[str, Callable[[str], str]] = {
    "strip": str.strip,
    "lower": str.lower,
    "whitespace": lambda s: " ".join(s.split()),
    "punctuation": lambda s: s.translate(_PUNCTUATION),
    "articles": lambda s: _ARTICLES_RE.sub(" ", s),
    "number": lambda s: normalize_answer(s) or s,  # "1,080.00" == "1080"
}
SQUAD_NORMALIZATION = ("lower", "punctuation", "articles", "whitespace")  # as in the SQuAD v1.1 script
DEFAULT_NORMALIZATION = ("strip", "whitespace")


def normalize_text(text: str, steps: str | Sequence[str] = DEFAULT_NORMALIZATION) -> str:
    """Apply the named ``NORMALIZERS`` in order (``steps="squad"`` for SQuAD's normalization)."""
    if steps == "squad":
        steps = SQUAD_NORMALIZATION
    elif isinstance(steps, str):
        steps = (steps,)
    for step in steps:
        if step not in NORMALIZERS:
            raise ValueError(f"unknown normalization {step!r}; known: {', '.join(NORMALIZERS)} or 'squad'")
        text = NORMALIZERS[step](text)
    return text


@register_reward("format")
def format_reward(completion: str, **_) -> RewardResult:
    """1 when the completion ends with a well-formed ``#### <number>`` line and nothing after it."""
    well_formed = is_well_formed(completion)  # unicode minus signs included
    return RewardResult(float(well_formed), {"well_formed": well_formed})


@register_reward("exact_match")
def exact_match(completion: str, target=None, targets=None, normalize=DEFAULT_NORMALIZATION, **_) -> RewardResult:
    """1 when the normalized completion equals a normalized target.

    Reference keys: ``target`` (str) or ``targets`` (list of acceptable strings); ``normalize``:
    names from ``NORMALIZERS`` (default: strip and collapse whitespace; case matters) or "squad".
    """
    candidates = _targets(target, targets)
    predicted = normalize_text(completion, normalize)
    matched = next((t for t in candidates if normalize_text(t, normalize) == predicted), None)
    return RewardResult(float(matched is not None), {"normalized": predicted[:200], "matched": matched})


@register_reward("token_f1")
def token_f1(completion: str, target=None, targets=None, **_) -> RewardResult:
    """SQuAD-style token F1 of the completion against the best of ``target``/``targets``.

    Both sides are lowercased, stripped of punctuation and articles, and split on whitespace;
    F1 = 2PR/(P+R) over the multiset of shared tokens. If either side has no tokens, F1 is 1
    when both are empty and 0 otherwise.
    """
    predicted = normalize_text(completion, SQUAD_NORMALIZATION).split()
    best = {"f1": 0.0, "precision": 0.0, "recall": 0.0, "target": None}
    for candidate in _targets(target, targets):
        gold = normalize_text(candidate, SQUAD_NORMALIZATION).split()
        if not predicted or not gold:
            precision = recall = f1 = float(predicted == gold)
        else:
            shared = sum((Counter(predicted) & Counter(gold)).values())
            precision, recall = shared / len(predicted), shared / len(gold)
            f1 = 0.0 if shared == 0 else 2 * precision * recall / (precision + recall)
        if best["target"] is None or f1 > best["f1"]:
            best = {"f1": f1, "precision": precision, "recall": recall, "target": candidate}
    return RewardResult(best["f1"], best)


@register_reward("classification")
def classification(completion: str, label=None, labels=None, **_) -> RewardResult:
    """1 when the completion names the reference ``label``.

    With a label set ``labels``, the prediction is the completion itself if it is a label, else
    the one label it mentions (whole words, case-insensitive, longest label first so "not spam"
    is not read as "spam"); mentioning several labels is a hedge and scores 0. Without a label
    set, the normalized completion must equal the label.
    """
    if label is None or not str(label).strip():
        raise ValueError("classification needs a non-empty reference 'label'")
    gold = _label_key(label)
    text = _label_key(completion)
    if labels is None:
        return RewardResult(float(text == gold), {"predicted": text[:100], "label": str(label)})
    if isinstance(labels, str):
        raise ValueError("'labels' must be a list of labels, got one string")
    keys = {_label_key(x): str(x) for x in labels}
    if gold not in keys:
        raise ValueError(f"label {label!r} is not in the label set {sorted(keys.values())}")
    if text in keys:
        mentioned = [text]
    else:
        pattern = r"\b(" + "|".join(re.escape(k) for k in sorted(keys, key=len, reverse=True)) + r")\b"
        mentioned = sorted(set(re.findall(pattern, text)))
    predicted = keys[mentioned[0]] if len(mentioned) == 1 else None
    details = {"predicted": predicted, "label": keys[gold]}
    if len(mentioned) > 1:
        details["mentioned"] = [keys[k] for k in mentioned]
    return RewardResult(float(len(mentioned) == 1 and mentioned[0] == gold), details)


@register_reward("regression")
def regression(completion: str, target=None, max_rel_error: float = 1.0, min_scale: float = 1e-12, **_) -> RewardResult:
    """Graded by relative error: ``max(0, 1 - |y_hat - y| / (max_rel_error * max(|y|, min_scale)))``.

    Reference keys: ``target`` (number or numeric string); ``max_rel_error`` is the relative
    error that scores 0 (default 100%); ``min_scale`` keeps targets near 0 from dividing by 0
    (raise it to grade those by absolute error). The prediction is the final answer found in
    flexible mode (``####``, ``\\boxed{}``, then the last number).
    """
    goal = _number(target, "target")
    if not max_rel_error > 0 or not min_scale > 0:
        raise ValueError("regression needs max_rel_error > 0 and min_scale > 0")
    extracted = extract_final_answer(completion, "flexible")
    if extracted is None or not math.isfinite(extracted.value):
        return RewardResult(0.0, {"predicted": None})
    relative_error = abs(extracted.value - goal) / max(abs(goal), min_scale)
    value = max(0.0, 1.0 - relative_error / max_rel_error)
    return RewardResult(value, {"predicted": extracted.value, "relative_error": relative_error})


def _targets(target, targets) -> list[str]:
    candidates = [target] if target is not None else []
    if targets is not None:
        if isinstance(targets, str):
            raise ValueError("'targets' must be a list of strings, got one string (use 'target')")
        candidates += list(targets)
    if not candidates:
        raise ValueError("needs a reference 'target' or 'targets'")
    return [str(t) for t in candidates]


def _label_key(text) -> str:
    return " ".join(str(text).lower().split()).strip(string.punctuation + " ")


def _number(value, name: str) -> float:
    number = parse_number(value) if isinstance(value, str) else value
    if isinstance(number, bool) or not isinstance(number, numbers.Real) or not math.isfinite(number):
        raise ValueError(f"reference {name!r} must be a finite number, got {value!r}")
    return float(number)
