"""Chat messages under a model's chat template: the one renderer training, evaluation and serving use
(``render_messages``; the service's ``/v1/chat/completions`` calls it with the client's own messages),
and an environment's tool instructions joined to a conversation (``with_instructions``)."""

from __future__ import annotations

from typing import Any, Sequence


def instructions_joined(system_prompt: str, environment: Any) -> str:
    """``system_prompt`` with ``environment``'s instructions (how to call its tool) after it, if any."""
    instructions = (getattr(environment, "instructions", "") or "").strip()
    if not instructions:
        return system_prompt
    return f"{system_prompt}\n\n{instructions}" if system_prompt else instructions


def with_instructions(messages: list[dict[str, str]], environment: Any = None) -> list[dict[str, str]]:
    """A client's chat ``messages`` with ``environment``'s instructions (how to call its tool) as the
    policy was trained with them: appended to the conversation's system message, or as a system
    message of their own before the others when there is none. Unchanged without instructions."""
    instructions = instructions_joined("", environment)
    if not instructions:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": instructions_joined(messages[0]["content"], environment)}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


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
