"""The stop checker: why a row ends, by one set of rules for training, evaluation and serving.

A row ends at an end token (``"eos"``, or ``"answer"`` when its last line is an answer line), right
after it completes an answer line (``"answer"``), once its text holds a stop string (``"stop"``; the text
is not cut here), at its token budget (``"length"``), or when its caller cancels it (``"cancelled"``).
What an answer line is and which strings stop a row is the request's :class:`StopRule` (a task's parser
gives it, ``rlvr.tasks.parsers``): the engine knows no answer format.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

FINISH_REASONS = ("eos", "answer", "stop", "length", "cancelled")
TAIL_TOKENS = 48  # tokens decoded to check for a just-completed answer line


@dataclass(frozen=True)
class StopRule:
    """Where a request's rows end besides end tokens and the budget: once the text holds one of ``strings``
    (``"stop"``), or right after a completed line that ``answer_line`` accepts (``"answer"``)."""

    strings: tuple[str, ...] = ()
    answer_line: Callable[[str], bool] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "strings", tuple(self.strings))
        if not all(isinstance(s, str) and s for s in self.strings):
            raise ValueError(f"stop strings must be non-empty strings, got {self.strings}")

    def with_strings(self, strings: tuple[str, ...]) -> StopRule:
        """This rule with ``strings`` added (a client's own stop strings)."""
        return StopRule(tuple(dict.fromkeys(self.strings + tuple(strings))), self.answer_line)


NO_STOP_RULE = StopRule()


class StopChecker:
    """The finish rules of one model and tokenizer (``stop_token_ids``: default eos, pad, ``<|im_end|>``
    and the generation config's end tokens)."""

    def __init__(self, model: Any, tokenizer: Any, stop_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.stop_ids = default_stop_token_ids(model, tokenizer) if stop_token_ids is None else {int(i) for i in stop_token_ids}
        self.newlines = newline_counts(tokenizer, model)

    def finish_reason(self, ids: list[int], max_new_tokens: int, rule: StopRule) -> str | None:
        """Why a row whose completion is ``ids`` (its newest token last) ends now under ``rule``, or None."""
        token, answer_line, stop_strings = ids[-1], rule.answer_line, rule.strings
        if token in self.stop_ids:
            if answer_line is not None:
                tail = self.tokenizer.decode(ids[-TAIL_TOKENS:-1])
                return "answer" if answer_line(tail.rsplit("\n", 1)[-1]) else "eos"
            return "eos"
        if answer_line is not None and (count := int(self.newlines[token])) > 0:
            lines = self.tokenizer.decode(ids[-TAIL_TOKENS:]).split("\n")
            if any(answer_line(line) for line in lines[-1 - count : -1]):  # the lines this token closed
                return "answer"
        if stop_strings:
            window = max(len(s.encode()) for s in stop_strings) + 1  # each token holds at least one byte
            tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=True)
            if any(s in tail for s in stop_strings):
                return "stop"
        if len(ids) >= max_new_tokens:
            return "length"
        return None


def default_stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """eos, pad and ``<|im_end|>`` of the tokenizer, and the model's generation-config end tokens."""
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return {int(i) for i in ids if i is not None}


_NEWLINE_TABLES: dict[int, tuple[Any, torch.Tensor]] = {}


def newline_counts(tokenizer: Any, model: Any) -> torch.Tensor:
    """Number of newlines in each token's text, over the model's vocabulary (cached per tokenizer)."""
    vocab_size = model.get_output_embeddings().weight.shape[0]
    cached = _NEWLINE_TABLES.get(id(tokenizer))
    if cached is not None and cached[0]() is tokenizer and len(cached[1]) == vocab_size:
        return cached[1]
    known = min(len(tokenizer), vocab_size)
    texts = tokenizer.batch_decode([[i] for i in range(known)])
    counts = torch.zeros(vocab_size, dtype=torch.long)
    counts[:known] = torch.tensor([text.count("\n") for text in texts])
    _NEWLINE_TABLES[id(tokenizer)] = (weakref.ref(tokenizer), counts)
    return counts
