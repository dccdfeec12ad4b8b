"""Rewards on text: ``format``, ``exact_match``, ``token_f1``, ``classification``, ``regression``, and on a
labelled final line (:func:`labelled_answer`): ``qa_exact_match``, ``qa_token_f1``, ``answer_line``,
``label_match``, ``label_line``."""

from __future__ import annotations

import math
import numbers
import re
import string
from collections import Counter
from functools import lru_cache
from typing import Callable, Sequence

from rlvr.answers import extract_final_answer, final_line, is_well_formed, normalize_answer, parse_number
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
    gold = label_key(label)
    text = label_key(completion)
    if labels is None:
        return RewardResult(float(text == gold), {"predicted": text[:100], "label": str(label)})
    if isinstance(labels, str):
        raise ValueError("'labels' must be a list of labels, got one string")
    keys = {label_key(x): str(x) for x in labels}
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


def labelled_answer(text: str, label: str = "Answer") -> str | None:
    """The text after the last ``<label>:`` (any case) with text after it on its line, stripped of spaces
    and ``*``; else the last non-empty line; None for a blank text. The QA and classification tasks' answer
    span (their parsers and rewards call this one function)."""
    found = [value for value in (match.group(1).strip().strip("*").strip() for match in _label_re(label).finditer(text)) if value]
    return found[-1] if found else final_line(text)


def labelled_line(line: str, label: str = "Answer") -> bool:
    """Whether ``line`` opens (after markdown marks) with ``<label>:`` (any case) and has text after it."""
    return re.match(rf"[\s*#>_]*{re.escape(label)}\s*:[\s*]*\S", line, re.IGNORECASE) is not None


def has_labelled_line(text: str, label: str = "Answer") -> bool:
    """Whether some line of ``text`` is a :func:`labelled_line`: the QA and classification format check."""
    return any(labelled_line(line, label) for line in text.splitlines())


@register_reward("qa_exact_match")
def qa_exact_match(completion: str, answers=None, **_) -> RewardResult:
    """1 when the answer span (:func:`labelled_answer`) equals one of ``answers`` under SQuAD's normalization
    (lower case, no punctuation, no articles, single spaces): SQuAD v1.1's and NQ-open's exact match."""
    span = labelled_answer(completion)
    result = exact_match(span or "", targets=_answer_list(answers), normalize=SQUAD_NORMALIZATION)
    return RewardResult(result.value, {"answer": span, **result.details})


@register_reward("qa_token_f1")
def qa_token_f1(completion: str, answers=None, **_) -> RewardResult:
    """``token_f1`` of the answer span (:func:`labelled_answer`) against the best of ``answers``: SQuAD's F1."""
    span = labelled_answer(completion)
    result = token_f1(span or "", targets=_answer_list(answers))
    return RewardResult(result.value, {"answer": span, **result.details})


@register_reward("answer_line")
def answer_line(completion: str, **_) -> RewardResult:
    """1 when a line opens with ``Answer:`` and has an answer after it (:func:`labelled_line`)."""
    return RewardResult(float(has_labelled_line(completion, "Answer")))


@register_reward("label_match")
def label_match(completion: str, label=None, labels=None, **_) -> RewardResult:
    """``classification`` on the span after the last ``Label:`` (else the last non-empty line): 1 when
    it names the reference ``label``; a span mentioning several labels of ``labels`` is a hedge and scores 0."""
    span = labelled_answer(completion, "Label")
    result = classification(span or "", label=label, labels=labels)
    return RewardResult(result.value, {"span": span, **result.details})


@register_reward("label_line")
def label_line(completion: str, **_) -> RewardResult:
    """1 when a line opens with ``Label:`` and has a label after it (:func:`labelled_line`)."""
    return RewardResult(float(has_labelled_line(completion, "Label")))


def _answer_list(answers) -> list[str]:
    if isinstance(answers, str) or not isinstance(answers, (list, tuple)) or not answers:
        raise ValueError(f"needs a reference 'answers': a non-empty list of acceptable answers, got {answers!r:.80}")
    return [str(answer) for answer in answers]


@lru_cache(maxsize=None)
def _label_re(label: str) -> re.Pattern:
    """``<label>:`` and the rest of its line, at the last ``<label>:`` of the line."""
    marker = rf"\b{re.escape(label)}\s*:"
    return re.compile(rf"{marker}(?!.*{marker})(.*)", re.IGNORECASE)


def _targets(target, targets) -> list[str]:
    candidates = [target] if target is not None else []
    if targets is not None:
        if isinstance(targets, str):
            raise ValueError("'targets' must be a list of strings, got one string (use 'target')")
        candidates += list(targets)
    if not candidates:
        raise ValueError("needs a reference 'target' or 'targets'")
    return [str(t) for t in candidates]


def label_key(text) -> str:
    """A label as ``classification`` compares it: lower case, single spaces, no punctuation at its ends."""
    return " ".join(str(text).lower().split()).strip(string.punctuation + " ")


def _number(value, name: str) -> float:
    number = parse_number(value) if isinstance(value, str) else value
    if isinstance(number, bool) or not isinstance(number, numbers.Real) or not math.isfinite(number):
        raise ValueError(f"reference {name!r} must be a finite number, got {value!r}")
    return float(number)
