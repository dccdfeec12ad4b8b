"""Prompt-prefix caching for ``rlvr.generation.engine`` (vLLM's automatic prefix caching, in blocks).

A prompt's keys and values at positions 0 .. n - 1 depend on its first n tokens only, so the engine keeps
them in blocks of ``block_tokens`` tokens, each named by its tokens and the block before it (a hash
chain, as vLLM's); a new prompt prefills only what follows the longest run of blocks it shares with
earlier prompts, and always its last token. Blocks live within a byte limit, least recently used first
out (docs/architecture.md, "The generation engine"); the engine evicts them before it refuses a request
(:meth:`PrefixCache.shrink_to`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch
from transformers import DynamicCache

BLOCK_TOKENS = 16


@dataclass(eq=False)
class _Block:
    parent: int | None  # the key of the block before it (None: the prompt's first)
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer [KV heads, block tokens, head dim]
    values: list[torch.Tensor]


class PrefixCache:
    """Key and value blocks of prompt prefixes, at most ``limit_bytes`` of them (0: off)."""

    def __init__(self, bytes_per_token: int, limit_bytes: int, block_tokens: int = BLOCK_TOKENS):
        self.block_bytes, self.limit_bytes, self.block_tokens = bytes_per_token * block_tokens, limit_bytes, block_tokens
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self.hit_tokens = 0  # prompt tokens taken from the cache

    @property
    def bytes(self) -> int:
        return len(self._blocks) * self.block_bytes

    def _chain(self, ids: Sequence[int]) -> Iterator[tuple[int, tuple[int, ...]]]:
        """(key, tokens) of each whole block of ``ids`` but the last token (always prefilled), lazily."""
        parent = None
        for start in range(0, len(ids) - 1 - self.block_tokens + 1, self.block_tokens):
            tokens = tuple(ids[start : start + self.block_tokens])
            parent = hash((parent, tokens))
            yield parent, tokens

    def _held(self, chain: Iterable[tuple[int, tuple[int, ...]]]) -> Iterator[tuple[int, _Block]]:
        """(key, block) of the run of a ``chain``'s blocks held, from its first (a hash collision is a miss)."""
        parent = None
        for key, tokens in chain:
            block = self._blocks.get(key)
            if block is None or block.tokens != tokens or block.parent != parent:
                return
            yield key, block
            parent = key

    def _cached_chain(self, ids: Sequence[int]) -> list[tuple[int, _Block | None]]:
        """The whole chain of ``ids`` with the cached block of each key (None past the first miss)."""
        chain = list(self._chain(ids))
        held: list[tuple[int, _Block | None]] = list(self._held(chain))
        return held + [(key, None) for key, _ in chain[len(held) :]]

    def _touch(self, keys: list[int]) -> None:
        for key in reversed(keys):  # the first block most recent: evicted after every block that continues it
            self._blocks.move_to_end(key)

    def uncached_tokens(self, ids: Sequence[int]) -> int:
        """Of a prompt not started, the tokens it would prefill: all but the run of its blocks held now
        (read only, safe from any thread: the estimates ask it beside the engine's steps)."""
        if not self.limit_bytes:
            return len(ids)
        return len(ids) - self.block_tokens * sum(1 for _ in self._held(self._chain(ids)))

    def lookup(self, ids: Sequence[int], config: Any) -> tuple[int, DynamicCache | None]:
        """(tokens of ``ids`` found, a prompt cache holding their keys and values), (0, None) on a miss."""
        if not self.limit_bytes:
            return 0, None
        hits = list(self._held(self._chain(ids)))
        if not hits:
            return 0, None
        self._touch([key for key, _ in hits])
        cache = DynamicCache(config=config)
        for index, layer in enumerate(cache.layers):
            keys = torch.cat([block.keys[index] for _, block in hits], dim=1).unsqueeze(0)
            values = torch.cat([block.values[index] for _, block in hits], dim=1).unsqueeze(0)
            layer.update(keys, values)
        self.hit_tokens += len(hits) * self.block_tokens
        return len(hits) * self.block_tokens, cache

    def store(self, ids: Sequence[int], cache: DynamicCache, room_bytes: int) -> None:
        """Keep the blocks of a prefilled prompt (``cache`` holds its keys and values) that are not
        cached yet, within ``limit_bytes`` and ``room_bytes`` (what the KV budget leaves), evicting
        the least recently used blocks of other prompts for them."""
        limit = min(self.limit_bytes, room_bytes)
        chain = self._cached_chain(ids)
        if not chain or limit < self.block_bytes:
            return
        for number, (key, block) in enumerate(chain):
            if block is not None:
                continue
            if self.bytes + self.block_bytes > limit:
                self._evict(limit - self.block_bytes, keep={k for k, _ in chain})
                if self.bytes + self.block_bytes > limit:
                    break
            span = slice(number * self.block_tokens, (number + 1) * self.block_tokens)
            tokens = tuple(ids[span])
            self._blocks[key] = _Block(
                chain[number - 1][0] if number else None,
                tokens,
                [layer.keys[0, :, span].clone() for layer in cache.layers],
                [layer.values[0, :, span].clone() for layer in cache.layers],
            )
        self._touch([key for key, _ in chain if key in self._blocks])

    def shrink_to(self, limit_bytes: int) -> None:
        """Evict least recently used blocks until at most ``limit_bytes`` are held."""
        self._evict(limit_bytes)

    def _evict(self, limit_bytes: int, keep: frozenset[int] | set[int] = frozenset()) -> None:
        for key in [k for k in self._blocks if k not in keep]:
            if self.bytes <= limit_bytes:
                return
            del self._blocks[key]
