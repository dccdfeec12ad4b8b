"""GSM8k's prompt: a system prompt asking for the reasoning and a final ``#### <number>`` line, with one
worked example (``SYSTEM_PROMPT``), and the messages and text of one question under it (``render_prompt``)."""

from __future__ import annotations

from typing import Any

from rlvr.chat import instructions_joined, render_messages

SYSTEM_PROMPT = (
    "Solve the math word problem step by step, then give the final answer on the last line as '#### <number>'.\n\n"
    "Example:\n"
    "Question: Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples are left?\n"
    "Answer: Tom has 3 * 4 = 12 apples. After eating 2, he has 12 - 2 = 10 apples.\n"
    "#### 10"
)
"""One worked example in the system prompt: the embedded 135M model then ends 40% of its GSM8k
test answers with a well-formed ``####`` line (docs/results.md), which gives GRPO's format reward
a signal from the first step."""


def system_prompt_for(environment: Any = None) -> str:
    """The system prompt of a policy that rolls out in ``environment`` (an ``rlvr.environments``
    Environment, None for single-turn): :data:`SYSTEM_PROMPT` with the environment's instructions
    (how to call its tool) appended. Training, evaluation and serving all ask here."""
    return instructions_joined(SYSTEM_PROMPT, environment)


def build_messages(question: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat messages for one problem: a system prompt asking for reasoning and a final '#### <number>' line."""
    question = question.strip()
    if not question:
        raise ValueError("question is empty")
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def render_prompt(tokenizer: Any, question: str, system_prompt: str = SYSTEM_PROMPT) -> str:
    """The prompt of one problem: ``build_messages`` rendered by :func:`render_messages`.

    A question holding one of the tokenizer's special tokens is refused (``ControlTokensError``, a
    ``ValueError``, naming ``question``).
    """
    return render_messages(tokenizer, build_messages(question, system_prompt), fields=("system_prompt", "question"))
