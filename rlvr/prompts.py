"""The one prompt builder shared by training, evaluation and serving."""

from __future__ import annotations

from typing import Any

SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem step by step, showing each calculation. "
    "Then write the final answer on its own last line in the form '#### <number>'."
)


def build_messages(question: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat messages for one problem: a system prompt asking for reasoning and a final '#### <number>' line."""
    question = question.strip()
    if not question:
        raise ValueError("question is empty")
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def render_prompt(tokenizer: Any, question: str, system_prompt: str = SYSTEM_PROMPT) -> str:
    """The prompt text a chat tokenizer feeds the model, ending where the assistant's turn begins."""
    return tokenizer.apply_chat_template(
        build_messages(question, system_prompt), tokenize=False, add_generation_prompt=True
    )
