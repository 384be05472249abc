"""The token masks a request asks for, checked and turned into what the target masks: vLLM's
``bad_words`` (words the answer never spells, as token sequences) and ``allowed_token_ids`` (the only
tokens the answer is made of; ``target_service.allowed_tokens``).

A bad word is tokenized as it would open the text (no space before it) and, where the tokenizer spells
it otherwise after a space (another first token, the same number of tokens), as it would follow a
space too: vLLM's rule, so that a word is banned both at the start and in the middle of the answer.
The target then masks a sequence's last token wherever the generated text ends with the rest of it
(``target_service.bad_words``), speculating or not. A word is banned as these spellings only: the
same letters split into other tokens (a longer word that contains it, another casing) are not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.errors import InvalidRequest
from tandem.rpc.types import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS


def bad_word_sequences(words: Sequence[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """The token sequences that spell ``words`` (none for no words); a word that is blank, spells more
    than ``MAX_BAD_WORD_TOKENS`` tokens, or words that make more than ``MAX_BAD_WORDS`` sequences are
    refused, naming ``bad_words``."""
    sequences: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        plain = tuple(tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"]) if word.strip() else ()
        if not plain:
            raise InvalidRequest(f"bad_words[{i}] is blank; each must be a word to ban", param="bad_words")
        spaced = tuple(tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"])
        for ids in (plain, spaced):
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise InvalidRequest(f"bad_words[{i}] spells {len(ids)} tokens, more than the {MAX_BAD_WORD_TOKENS} "
                                     "a banned word may have", param="bad_words")
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORDS:
        raise InvalidRequest(f"bad_words spell {len(sequences)} token sequences, more than the {MAX_BAD_WORDS} "
                             "allowed", param="bad_words")
    return tuple(dict.fromkeys(sequences))  # the same spelling twice is banned once


def allowed_token_ids(ids: Sequence[int] | None, vocab_size: int, others: Mapping[str, bool]) -> tuple[int, ...]:
    """vLLM's allowed_token_ids in increasing order (none for None): a non-empty list of ids in the
    vocabulary, refused with what the request also asks for that could mask every one of them on some
    row (``others``: such a field's name and whether the request asks for it)."""
    if ids is None:
        return ()
    if not ids:
        raise InvalidRequest("allowed_token_ids must name at least one token id", param="allowed_token_ids")
    outside = next((t for t in ids if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise InvalidRequest(f"allowed_token_ids: token id {outside} is outside the vocabulary [0, {vocab_size})",
                             param="allowed_token_ids")
    for name, given in others.items():
        if given:
            raise InvalidRequest(f"allowed_token_ids cannot be combined with {name}: together they may leave no "
                                 "token to choose", param="allowed_token_ids")
    return tuple(sorted(set(ids)))


__all__ = ["allowed_token_ids", "bad_word_sequences"]
