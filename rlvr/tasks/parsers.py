"""How a task reads a completion: one :class:`Parser` per answer format (as ``verifiers`` splits parser from rubric).

A parser finds the answer span (``answer``), says whether the completion is in the task's format
(``well_formed``) and where a row stops (``stop_rule``): rewards, evaluation, the service, its traffic
rows and the drift report all ask the task's parser, so each format is read in one place. Built in:
``hash_number`` (GSM8k's last ``#### <number>`` line), ``answer_tags`` (``<answer>...</answer>``),
``code_block`` (the last fenced block), ``boxed`` (``\\boxed{}``), ``answer_colon`` / ``label_colon``
(an ``Answer:`` / ``Label:`` line) and ``final_line`` (the last non-empty line).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from rlvr.answers import extract_final_answer, final_line, is_well_formed, last_boxed
from rlvr.generation.stops import StopRule
from rlvr.rewards.code import last_code_block
from rlvr.rewards.reasoning_gym import extract_tagged_answer, has_one_answer_span
from rlvr.rewards.text import has_labelled_line, labelled_answer, labelled_line


@dataclass(frozen=True)
class Parser:
    """An answer format: ``answer(text)`` the span (None when there is none), ``well_formed(text)`` the
    format check, ``stop_strings`` and ``answer_line`` (a completed line that ends a row) its stop rule."""

    name: str
    answer: Callable[[str], str | None]
    well_formed: Callable[[str], bool]
    stop_strings: tuple[str, ...] = ()
    answer_line: Callable[[str], bool] | None = None

    def stop_rule(self, extra_strings: tuple[str, ...] = ()) -> StopRule:
        """Where a row of this format ends: its stop strings (and ``extra_strings``) and its answer line."""
        return StopRule(tuple(dict.fromkeys(self.stop_strings + tuple(extra_strings))), self.answer_line)


def hash_number_answer(text: str) -> str | None:
    """The number on the last ``####`` line, normalized (strict extraction)."""
    found = extract_final_answer(text, "strict")
    return found.text if found else None


def code_block_well_formed(text: str) -> bool:
    """A fenced code block with code in it."""
    block = last_code_block(text)
    return bool(block and block.strip())


def has_boxed(text: str) -> bool:
    """A closed, non-empty ``\\boxed{...}``."""
    return last_boxed(text) is not None


HASH_NUMBER = Parser("hash_number", hash_number_answer, is_well_formed, answer_line=is_well_formed)
ANSWER_TAGS = Parser("answer_tags", extract_tagged_answer, has_one_answer_span, stop_strings=("</answer>",))
CODE_BLOCK = Parser("code_block", last_code_block, code_block_well_formed, stop_strings=("\n```",))
BOXED = Parser("boxed", last_boxed, has_boxed)
FINAL_LINE = Parser("final_line", final_line, bool)  # any non-blank completion has a final line


def labelled_line_parser(name: str, label: str) -> Parser:
    """The ``<label>: <answer>`` format: the span after the last ``<label>:`` (else the last non-empty line),
    well formed with a line opening with ``<label>:``, and a row ends right after such a line."""
    return Parser(name, partial(labelled_answer, label=label), partial(has_labelled_line, label=label), answer_line=partial(labelled_line, label=label))


ANSWER_COLON = labelled_line_parser("answer_colon", "Answer")  # the qa task's final ``Answer: <answer>`` line
LABEL_COLON = labelled_line_parser("label_colon", "Label")  # the classification task's final ``Label: <label>`` line
