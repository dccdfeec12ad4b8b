"""The served tokenizer's vocabulary as clients see it: each token's text and its own bytes.

A byte-level BPE vocabulary (GPT-2's, SmolLM's, Qwen's) spells each byte as one printable character
(GPT-2's ``bytes_to_unicode`` table); a token's bytes are its spelling mapped back, so a token that
splits a multi-byte character holds part of it, and joining the tokens' bytes rebuilds the text
exactly. Decoding one such token alone gives U+FFFD, whose bytes are not the token's.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte fallback


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: the character that spells each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[chr(byte)] = byte
        else:
            spelled[chr(256 + extra)] = byte
            extra += 1
    return spelled


class Vocabulary:
    """Each token id's bytes and text (special tokens as their text), built once per tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        decoder, special = byte_decoder(), set(tokenizer.all_special_ids)
        spellings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self._bytes: list[bytes] = []
        for token_id, spelling in enumerate(spellings):
            spelling = spelling or ""
            if token_id not in special and all(c in decoder for c in spelling):
                self._bytes.append(bytes(decoder[c] for c in spelling))
            elif match := _BYTE_TOKEN.match(spelling):
                self._bytes.append(bytes([int(match.group(1), 16)]))
            else:
                self._bytes.append(spelling.encode())

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        return [self._bytes[t] if 0 <= t < len(self._bytes) else b"" for t in token_ids]

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text, special tokens included (as vLLM's log-probs show them)."""
        return self.tokenizer.batch_decode([[t] for t in token_ids])
