"""Tokens as a response shows them: the text each decodes to alone, and its exact bytes.

A token is not always text of its own: a byte-fallback piece (``<0xE2>``) or a byte-level BPE token
can hold part of a UTF-8 character. Decoded alone such a token shows U+FFFD; its ``bytes`` are
exact, so their concatenation over a response is the UTF-8 of its text.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class TokenStrings:
    """Token id -> (its text decoded alone, its exact bytes), cached (top alternatives repeat)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        # Byte-level BPE (GPT-2, Llama 3): every piece character stands for one byte.
        self._byte_of = {c: b for b, c in bytes_to_unicode().items()} if "ByteLevel" in repr(decoder) else None

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 (one instance per served model, kept for its life)
    def of(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        text = self.tokenizer.decode([token_id])
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            byte = _BYTE_PIECE.fullmatch(piece)
            if byte is not None:
                return text, (int(byte.group(1), 16),)
            if self._byte_of is not None and piece and all(c in self._byte_of for c in piece):
                return text, tuple(self._byte_of[c] for c in piece)
        return text, tuple(text.encode("utf-8"))
