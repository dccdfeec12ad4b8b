"""The stop checker: why a row ends, by one set of rules for training, evaluation and serving.

A row ends at an end token (``"eos"``, or ``"answer"`` when it closes a ``#### <number>`` line), right
after a completed answer line (``"answer"``), once its text holds a stop string (``"stop"``; the text is
not cut here), at its token budget (``"length"``), or when its caller cancels it (``"cancelled"``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from rlvr.answers import is_well_formed

FINISH_REASONS = ("eos", "answer", "stop", "length", "cancelled")
TAIL_TOKENS = 48  # tokens decoded to check for a just-completed '#### <number>' line


class StopChecker:
    """The finish rules of one model and tokenizer (``stop_token_ids``: default eos, pad, ``<|im_end|>``
    and the generation config's end tokens)."""

    def __init__(self, model: Any, tokenizer: Any, stop_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.stop_ids = default_stop_token_ids(model, tokenizer) if stop_token_ids is None else {int(i) for i in stop_token_ids}
        self.newlines = newline_counts(tokenizer, model)

    def finish_reason(self, ids: list[int], max_new_tokens: int, stop_at_final_answer: bool, stop_strings: tuple[str, ...]) -> str | None:
        """Why a row whose completion is ``ids`` (its newest token last) ends now, or None."""
        token = ids[-1]
        if token in self.stop_ids:
            if stop_at_final_answer:
                tail = self.tokenizer.decode(ids[-TAIL_TOKENS:-1])
                return "answer" if is_well_formed(tail.rsplit("\n", 1)[-1]) else "eos"
            return "eos"
        if stop_at_final_answer and (count := int(self.newlines[token])) > 0:
            lines = self.tokenizer.decode(ids[-TAIL_TOKENS:]).split("\n")
            if any(is_well_formed(line) for line in lines[-1 - count : -1]):  # the lines this token closed
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
