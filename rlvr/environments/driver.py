"""How an engine drives a row's episode (``rlvr.generation.engine`` for training, evaluation and serving).

The engine shows each policy token to the row's :class:`EpisodeDriver`; when the episode answers with
an :class:`~rlvr.environments.base.Injection`, the driver tokenizes its text into a queue of forced
tokens, and for the next decode steps the engine feeds the row those tokens instead of sampled ones
(one per step, through the same decode call, so the row's KV cache grows by them with no re-prefill).
Forced tokens are the environment's: the engine marks them (``environment_mask``), records log-prob 0,
never ends the row on them and does not show them to the episode; they count against the token budget.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from rlvr.environments.base import Environment, Injection, SingleTurn, ToolCall


def drives_episodes(environment: Environment | None) -> bool:
    """Whether rows need episodes: any environment but none or the single-turn default (which never injects)."""
    return environment is not None and not isinstance(environment, SingleTurn)


class TokenTexts:
    """Each token's text, decoded once per tokenizer (what an episode's ``observe`` is shown)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __getitem__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text


class EpisodeDriver:
    """One row's episode as an engine drives it: the policy's tokens in, the environment's forced tokens out."""

    def __init__(self, environment: Environment, tokenizer: Any, texts: TokenTexts):
        self.episode = environment.episode()
        self.tokenizer, self.texts = tokenizer, texts
        self.forced: deque[int] = deque()  # the environment's tokens still to be written into the row
        self.calls: list[ToolCall] = []  # the calls whose injections the row was given, in order

    def next_forced(self) -> int | None:
        """The next token the environment writes into the row, or None when the policy is to sample."""
        return self.forced.popleft() if self.forced else None

    def observe(self, token: int, ended_turn: bool) -> bool:
        """Show the episode the policy's new token; True when it answered (the row must go on)."""
        return self.inject(self.episode.observe(self.texts[token], ended_turn))

    def inject(self, injection: Injection | None) -> bool:
        """Queue an injection's tokens (the ChatML markers of a tool turn become special tokens)."""
        if injection is None:
            return False
        self.forced.extend(self.tokenizer(injection.text, add_special_tokens=False).input_ids)
        if injection.call is not None:
            self.calls.append(injection.call)
        return True


def episode_drivers(environment: Environment | None, tokenizer: Any, rows: int) -> list[EpisodeDriver] | None:
    """A driver per row, or None where rows need none (see :func:`drives_episodes`)."""
    if not drives_episodes(environment):
        return None
    texts = TokenTexts(tokenizer)
    return [EpisodeDriver(environment, tokenizer, texts) for _ in range(rows)]
