"""reasoning-gym's own grading: ``reasoning_gym_score`` (partial credit), ``reasoning_gym_correct``, ``answer_tags``.

The answer is the last ``<answer>...</answer>`` span, stripped, and the dataset's own
``score_answer(answer, entry)`` grades it. The reference holds the key that regenerates the entry
(``dataset``, ``config``, ``seed``, ``size``, ``index``, ``question_sha256``) and, when it survives JSON
exactly (:func:`encode_entry`: tuples, sets and non-string keys tagged), the ``entry`` itself;
without one the entry is regenerated (datasets are deterministic per seed and index) and must hash to
the same question. Scorers run arbitrary code: the ``RewardPool`` bounds them with its timeout.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math

from rlvr.rewards.registry import RewardResult, register_reward

_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
_TAGS = {"__tuple__": tuple, "__set__": set, "__frozenset__": frozenset}
_PLAIN = (str, int, float, bool, type(None))


@register_reward("reasoning_gym_score")
def reasoning_gym_score(completion: str, dataset: str, config: dict | None, seed: int, size: int, index: int, **reference) -> RewardResult:
    """The dataset's ``score_answer`` of the completion's answer, in [0, 1]; no answer span scores 0.

    Details: ``extracted`` (the answer), ``score``, and ``reason`` when there was no answer.
    """
    answer = extract_tagged_answer(completion)
    if answer is None:
        return RewardResult(0.0, {"extracted": None, "score": 0.0, "reason": "no <answer>...</answer> span"})
    scorer = reasoning_gym_dataset(dataset, json.dumps(config or {}, sort_keys=True), seed, size)
    entry = (
        decode_entry(reference["entry"])
        if reference.get("entry") is not None
        else regenerated_entry(dataset, config, seed, size, index, reference.get("question_sha256"))
    )
    raw = scorer.score_answer(answer, entry)
    value = float(raw)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"reasoning-gym dataset {dataset!r} scored {raw!r}, outside [0, 1]")
    return RewardResult(value, {"extracted": answer, "score": value})


@register_reward("reasoning_gym_correct")
def reasoning_gym_correct(completion: str, **reference) -> RewardResult:
    """1 when ``reasoning_gym_score`` is exactly 1.0, else 0 (same details)."""
    result = reasoning_gym_score(completion, **reference)
    return RewardResult(float(result.value == 1.0), result.details)


@register_reward("answer_tags")
def answer_tags(completion: str, **_) -> RewardResult:
    """1 when the completion holds exactly one ``<answer>`` and one ``</answer>``, in that order."""
    return RewardResult(float(has_one_answer_span(completion)), {"opening": completion.count(_ANSWER_OPEN), "closing": completion.count(_ANSWER_CLOSE)})


def has_one_answer_span(completion: str) -> bool:
    """Exactly one ``<answer>`` and one ``</answer>``, in that order: the format reasoning-gym asks for."""
    opening, closing = completion.count(_ANSWER_OPEN), completion.count(_ANSWER_CLOSE)
    return opening == closing == 1 and completion.index(_ANSWER_OPEN) < completion.index(_ANSWER_CLOSE)


def extract_tagged_answer(completion: str) -> str | None:
    """The text of the last ``<answer>...</answer>`` span, stripped (``""`` for an empty one); None when there is none."""
    end = completion.rfind(_ANSWER_CLOSE)
    start = completion.rfind(_ANSWER_OPEN, 0, max(end, 0))
    if end < 0 or start < 0:
        return None
    return completion[start + len(_ANSWER_OPEN) : end].strip()


@functools.lru_cache(maxsize=32)
def reasoning_gym_dataset(name: str, config_json: str, seed: int, size: int):
    """The dataset ``name`` built as the task built it (cached per process: some load files or tables)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))


@functools.lru_cache(maxsize=256)
def _regenerated(name: str, config_json: str, seed: int, size: int, index: int) -> dict:
    return reasoning_gym_dataset(name, config_json, seed, size)[index]


def regenerated_entry(name: str, config: dict | None, seed: int, size: int, index: int, question_sha256: str | None) -> dict:
    """Entry ``index`` generated anew; raises ValueError when its question is not the one the task stored."""
    entry = copy.deepcopy(_regenerated(name, json.dumps(config or {}, sort_keys=True), seed, size, index))  # a scorer may change it
    if question_sha256 is not None and question_digest(entry["question"]) != question_sha256:
        raise ValueError(f"reasoning-gym {name!r} seed {seed} index {index} regenerates another question than the task stored (another reasoning-gym version?)")
    return entry


def question_digest(question: str) -> str:
    """The SHA-256 of a question's exact text: how a regenerated entry is checked against the stored one."""
    return hashlib.sha256(question.encode()).hexdigest()


def encode_entry(value):
    """``value`` as JSON-able data that :func:`decode_entry` turns back into an equal value of the same types.

    Tuples, sets and frozensets become ``{"__tuple__": [...]}`` etc., a dict with a non-string (or
    tag-like) key ``{"__dict__": [[key, value], ...]}``. Raises TypeError on anything else that is not
    exactly a str, int, finite float, bool or None (numpy scalars, objects): such entries are regenerated.
    """
    kind = type(value)
    if kind in _PLAIN:
        if kind is float and not math.isfinite(value):
            raise TypeError(f"non-finite float {value!r}")
        return value
    if kind is list:
        return [encode_entry(v) for v in value]
    if kind is dict:
        if all(type(k) is str for k in value) and not (len(value) == 1 and next(iter(value)) in (*_TAGS, "__dict__")):
            return {k: encode_entry(v) for k, v in value.items()}
        return {"__dict__": [[encode_entry(k), encode_entry(v)] for k, v in value.items()]}
    for tag, container in _TAGS.items():
        if kind is container:
            return {tag: [encode_entry(v) for v in value]}
    raise TypeError(f"{kind.__module__}.{kind.__qualname__} is not JSON-able exactly")


def decode_entry(value):
    """The inverse of :func:`encode_entry`."""
    if isinstance(value, list):
        return [decode_entry(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, items),) = value.items()
        if tag in _TAGS:
            return _TAGS[tag](decode_entry(v) for v in items)
        if tag == "__dict__":
            return {decode_entry(k): decode_entry(v) for k, v in items}
    return {k: decode_entry(v) for k, v in value.items()}


def storable_entry(entry: dict) -> dict | None:
    """``entry`` encoded for the reference when it comes back from JSON exactly equal, else None (regenerate it)."""
    try:
        encoded = encode_entry(entry)
    except TypeError:
        return None
    return encoded if decode_entry(json.loads(json.dumps(encoded))) == entry else None
