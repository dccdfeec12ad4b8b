"""The served tokenizer's vocabulary as clients see it: each token's text, its own bytes, and where
it starts in a decoded text.

A byte-level BPE vocabulary (GPT-2's, SmolLM's, Qwen's) spells each byte as one printable character
(GPT-2's ``bytes_to_unicode`` table); a token's bytes are its spelling mapped back, so a token that
splits a multi-byte character holds part of it, and joining the tokens' bytes rebuilds the text
exactly. Decoding one such token alone gives U+FFFD, whose bytes are not the token's: its text here is
its bytes written out, as vLLM's log-probs write them (``bytes:\\xe4\\xbd``), so no two tokens share one.
"""

from __future__ import annotations

import codecs
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


def written_bytes(data: bytes) -> str:
    """A token that is not valid UTF-8 on its own, as vLLM's log-probs name it: ``bytes:\\xe4\\xbd``."""
    return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


class Vocabulary:
    """Each token id's bytes and text (special tokens as their text) and where tokens start in their decoded
    text, built once per tokenizer."""

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
        added_special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        self._unspoken = special | added_special  # what decoding with skip_special_tokens leaves out
        self._partial = {i for i, b in enumerate(self._bytes) if i not in self._unspoken and not _is_utf8(b)}

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        return [self._bytes[t] if 0 <= t < len(self._bytes) else b"" for t in token_ids]

    def _decoded_bytes(self, token_ids: list[int]) -> list[bytes]:
        """Each token's bytes in the decoded text: none for the special tokens decoding skips."""
        return [b"" if t in self._unspoken else data for t, data in zip(token_ids, self.token_bytes(token_ids))]

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text, special tokens included (as vLLM's log-probs show them); a token holding
        part of a character as its bytes written out (``written_bytes``), distinct from every other."""
        texts = self.tokenizer.batch_decode([[t] for t in token_ids])
        return [written_bytes(self._bytes[t]) if t in self._partial else text for t, text in zip(token_ids, texts)]

    def text_offsets(self, token_ids: list[int]) -> list[int]:
        """Where each token starts in the text the tokens decode to (special tokens skipped), in characters:
        the offset of the character its first byte belongs to. Monotone, each at most the text's length."""
        decoder, offsets, chars = codecs.getincrementaldecoder("utf-8")("replace"), [], 0
        for data in self._decoded_bytes(token_ids):
            offsets.append(chars)
            chars += len(decoder.decode(data))
        return offsets

    def ends_inside_a_character(self, token_ids: list[int]) -> bool:
        """Whether the tokens' bytes end with an incomplete UTF-8 character (which decoding shows as U+FFFD)."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(b"".join(self._decoded_bytes(token_ids)))
        return bool(decoder.getstate()[0])
