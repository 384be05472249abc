"""Incremental detokenization that never emits a broken character.

Decoding token by token is wrong twice over: a multi-byte UTF-8 character split across byte-level
tokens decodes to U+FFFD until its last byte arrives, and SentencePiece-style tokenizers decode a
token differently at the start of a text (dropping its leading space) than in context. The classic
remedy (TGI, vLLM) keeps two offsets into the token list:

* ``prefix_offset``: where a short window of already-emitted tokens starts; decoding from there
  gives the new token its real context;
* ``read_offset``: where the not-yet-emitted tokens start.

Each step decodes ``tokens[prefix_offset:]`` and emits what it adds beyond
``tokens[prefix_offset:read_offset]`` unless it ends in U+FFFD (an incomplete character: wait for
more bytes). :meth:`flush` releases whatever is left at the end, so the concatenated output equals
``tokenizer.decode`` of all tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context for the first generated token (as in vLLM).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, context_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        """``context_ids``: tokens before the generated ones (the prompt); only its last few are kept,
        to decode the first generated tokens in context. They are never emitted."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """The text still held back (e.g. a trailing incomplete character, as U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        rest = self._decode(self._prefix_offset)[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        return rest
