"""The one prompt builder shared by training, evaluation and serving (``render_prompt``), and the
one renderer of chat messages under the model's chat template it is built on (``render_messages``,
which the service's ``/v1/chat/completions`` calls with the client's own messages)."""

from __future__ import annotations

from typing import Any, Sequence

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
    return _with_instructions(SYSTEM_PROMPT, environment)


def _with_instructions(system_prompt: str, environment: Any) -> str:
    """``system_prompt`` with ``environment``'s instructions (how to call its tool) after it, if any."""
    instructions = (getattr(environment, "instructions", "") or "").strip()
    if not instructions:
        return system_prompt
    return f"{system_prompt}\n\n{instructions}" if system_prompt else instructions


def with_instructions(messages: list[dict[str, str]], environment: Any = None) -> list[dict[str, str]]:
    """A client's chat ``messages`` with ``environment``'s instructions (how to call its tool) as the
    policy was trained with them: appended to the conversation's system message, or as a system
    message of their own before the others when there is none. Unchanged without instructions."""
    instructions = _with_instructions("", environment)
    if not instructions:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": _with_instructions(messages[0]["content"], environment)}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def build_messages(question: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat messages for one problem: a system prompt asking for reasoning and a final '#### <number>' line."""
    question = question.strip()
    if not question:
        raise ValueError("question is empty")
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


class ControlTokensError(ValueError):
    """Text holding the tokenizer's special tokens (``<|im_start|>``, ``<|im_end|>``, ...): the chat
    template pastes it verbatim, so it would open a turn of its own. ``field`` names the text."""

    def __init__(self, field: str, tokens: list[str]):
        self.field, self.tokens = field, tokens
        super().__init__(f"{field} contains the chat template's control tokens {', '.join(tokens)}")


def render_messages(tokenizer: Any, messages: list[dict[str, str]], fields: Sequence[str] | None = None) -> str:
    """Chat messages (``role``, ``content``) as the chat tokenizer feeds the model, ending where the
    assistant's turn begins. A message whose content holds one of the tokenizer's special tokens is
    refused (``ControlTokensError`` naming ``fields[i]``, default ``messages[i].content``)."""
    special = set(tokenizer.all_special_tokens)
    special.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    special.discard("")
    for i, message in enumerate(messages):
        found = sorted(token for token in special if token in message["content"])
        if found:
            raise ControlTokensError(fields[i] if fields else f"messages[{i}].content", found)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_prompt(tokenizer: Any, question: str, system_prompt: str = SYSTEM_PROMPT) -> str:
    """The prompt of one problem: ``build_messages`` rendered by :func:`render_messages`.

    A question holding one of the tokenizer's special tokens is refused (``ControlTokensError``, a
    ``ValueError``, naming ``question``).
    """
    return render_messages(tokenizer, build_messages(question, system_prompt), fields=("system_prompt", "question"))
