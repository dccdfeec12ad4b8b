"""The one prompt builder shared by training, evaluation and serving."""

from __future__ import annotations

from typing import Any

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


def build_messages(question: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat messages for one problem: a system prompt asking for reasoning and a final '#### <number>' line."""
    question = question.strip()
    if not question:
        raise ValueError("question is empty")
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def render_prompt(tokenizer: Any, question: str, system_prompt: str = SYSTEM_PROMPT) -> str:
    """The prompt text a chat tokenizer feeds the model, ending where the assistant's turn begins.

    A question holding one of the tokenizer's special tokens (``<|im_start|>``, ``<|im_end|>``, ...)
    is refused with ``ValueError``: the template pastes it verbatim, so it would open a turn of its own.
    """
    special = set(tokenizer.all_special_tokens)
    special.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    found = sorted(token for token in special if token and token in question)
    if found:
        raise ValueError(f"question contains the chat template's control tokens {', '.join(found)}")
    return tokenizer.apply_chat_template(
        build_messages(question, system_prompt), tokenize=False, add_generation_prompt=True
    )
