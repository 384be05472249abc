"""Input checks, run before any model work so bad input costs nothing and changes nothing.

Each check raises ``InvalidArgument`` with a message that names the field and the bad value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tandem.rpc.types import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
)
from target_service.types import DraftBlock
from target_service.errors import InvalidArgument
from target_service.session import SessionConfig

# A draft's q must sum to 1; float32 rounding of a renormalised top-k stays far inside this.
Q_SUM_TOLERANCE = 1e-2
# Session ids are the gateway's (a UUID and a prefix): anything much longer is not one.
MAX_SESSION_ID_LEN = 256
# The most drafts one block carries, chain or tree: the largest K any service accepts. A block's
# pass costs its rows, so a longer one would let one caller buy an arbitrarily long pass.
MAX_BLOCK_DRAFTS = 64


def check_session_id(session_id: str) -> None:
    if not session_id:
        raise InvalidArgument("session_id is empty")
    if len(session_id) > MAX_SESSION_ID_LEN:
        raise InvalidArgument(f"session_id is {len(session_id)} characters long, more than {MAX_SESSION_ID_LEN}")


def check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    for position, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"{field}[{position}] = {token} is outside the vocabulary [0, {vocab_size})")


def check_bad_words(config: SessionConfig, vocab_size: int) -> None:
    """At most MAX_BAD_WORDS sequences of 1..MAX_BAD_WORD_TOKENS ids in the vocabulary, and not with a
    grammar (which may allow nothing but a banned token where it must go on)."""
    if len(config.bad_words) > MAX_BAD_WORDS:
        raise InvalidArgument(f"bad_words: {len(config.bad_words)} sequences, more than the {MAX_BAD_WORDS} allowed")
    for i, sequence in enumerate(config.bad_words):
        if not 1 <= len(sequence) <= MAX_BAD_WORD_TOKENS:
            raise InvalidArgument(f"bad_words[{i}] must have 1 to {MAX_BAD_WORD_TOKENS} tokens, got {len(sequence)}")
        check_token_ids(f"bad_words[{i}]", sequence, vocab_size)
    if config.bad_words and config.grammar is not None:
        raise InvalidArgument("bad_words cannot be combined with a grammar: the grammar may allow only a banned token")


def check_allowed_tokens(config: SessionConfig, vocab_size: int) -> None:
    """Ids in the vocabulary, and none of the masks that could leave a row with no token at all: a
    grammar (it may need a token that is not allowed), bad words and min_tokens (they may mask every
    allowed token)."""
    check_token_ids("allowed_token_ids", config.allowed_token_ids, vocab_size)
    if not config.allowed_token_ids:
        return
    for name, given in (("a grammar", config.grammar is not None), ("bad_words", bool(config.bad_words)),
                        ("min_tokens", config.min_tokens > 0)):
        if given:
            raise InvalidArgument(f"allowed_token_ids cannot be combined with {name}: together they may leave no "
                                  "token to choose")


def check_config(config: SessionConfig, vocab_size: int) -> None:
    if config.max_new_tokens <= 0:
        raise InvalidArgument(f"max_new_tokens must be positive, got {config.max_new_tokens}")
    if math.isnan(config.temperature) or config.temperature < 0 or math.isinf(config.temperature):
        raise InvalidArgument(f"temperature must be a finite number >= 0, got {config.temperature}")
    if math.isnan(config.top_p) or not 0 <= config.top_p <= 1:
        raise InvalidArgument(f"top_p must be in [0, 1], got {config.top_p}")
    if config.top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0, got {config.top_k}")
    if math.isnan(config.min_p) or not 0 <= config.min_p <= 1:
        raise InvalidArgument(f"min_p must be in [0, 1], got {config.min_p}")
    if math.isnan(config.typical_p) or not 0 <= config.typical_p <= 1:
        raise InvalidArgument(f"typical_p must be in [0, 1], got {config.typical_p}")
    check_token_ids("stop_token_ids", config.stop_token_ids, vocab_size)
    if config.top_logprobs is not None and not 0 <= config.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {config.top_logprobs}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(config, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise InvalidArgument(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    repetition = config.repetition_penalty
    if not (math.isfinite(repetition) and 0 < repetition <= MAX_REPETITION_PENALTY):
        raise InvalidArgument(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {repetition}")
    for token, bias in config.logit_bias:
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise InvalidArgument(f"logit_bias: the bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, "
                                  f"{MAX_LOGIT_BIAS:g}], got {bias}")
    check_bad_words(config, vocab_size)
    check_allowed_tokens(config, vocab_size)
    if config.grammar is not None and len(config.grammar.spec) > MAX_GRAMMAR_CHARS:
        raise InvalidArgument(f"grammar: its spec has {len(config.grammar.spec)} characters, more than the "
                              f"{MAX_GRAMMAR_CHARS} this server compiles")
    if not 0 <= config.min_tokens <= config.max_new_tokens:
        raise InvalidArgument(f"min_tokens must be in [0, max_new_tokens = {config.max_new_tokens}], got "
                              f"{config.min_tokens}")
    if config.grammar is not None and config.min_tokens:
        raise InvalidArgument("min_tokens cannot be combined with a grammar: a constrained session ends when its "
                              "text is complete")
    if config.grammar is not None and config.ignore_eos:
        raise InvalidArgument("ignore_eos cannot be combined with a grammar: a constrained session ends when its "
                              "text is complete")


def check_prefill(
    session_id: str, prompt_token_ids: Sequence[int], config: SessionConfig, vocab_size: int, max_context_len: int
) -> None:
    check_session_id(session_id)
    if not prompt_token_ids:
        raise InvalidArgument("prompt_token_ids is empty")
    check_token_ids("prompt_token_ids", prompt_token_ids, vocab_size)
    check_config(config, vocab_size)
    if not 0 <= config.continued_tokens < len(prompt_token_ids):
        raise InvalidArgument(f"continued_tokens must be in [0, {len(prompt_token_ids)}) (the prompt has "
                              f"{len(prompt_token_ids)} tokens), got {config.continued_tokens}")
    total = len(prompt_token_ids) + config.max_new_tokens
    if total > max_context_len:
        raise InvalidArgument(
            f"prompt ({len(prompt_token_ids)} tokens) + max_new_tokens ({config.max_new_tokens}) = {total} "
            f"exceeds the context of {max_context_len} tokens"
        )


def check_block(block: DraftBlock, vocab_size: int) -> None:
    check_session_id(block.session_id)
    if block.base_len < 0:
        raise InvalidArgument(f"base_len must be >= 0, got {block.base_len}")
    if len(block.draft_token_ids) > MAX_BLOCK_DRAFTS:
        raise InvalidArgument(
            f"draft_token_ids has {len(block.draft_token_ids)} drafts, more than a block carries ({MAX_BLOCK_DRAFTS})"
        )
    check_token_ids("assumed_token_ids", block.assumed_token_ids, vocab_size)
    check_token_ids("draft_token_ids", block.draft_token_ids, vocab_size)
    if block.draft_parents:
        _check_tree(block)
    if not block.draft_probs:
        return
    if len(block.draft_probs) != len(block.draft_token_ids):
        raise InvalidArgument(
            f"draft_probs has {len(block.draft_probs)} entries for {len(block.draft_token_ids)} draft tokens"
        )
    for position, (token, q) in enumerate(zip(block.draft_token_ids, block.draft_probs)):
        _check_sparse_q(position, token, q.token_ids, q.probs, vocab_size)


def _check_tree(block: DraftBlock) -> None:
    parents, tokens = block.draft_parents, block.draft_token_ids
    if len(parents) != len(tokens):
        raise InvalidArgument(f"draft_parents has {len(parents)} entries for {len(tokens)} draft tokens")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise InvalidArgument(
                f"draft_parents[{i}] is {parent}: a parent is an earlier draft's index, "
                "or -1 for the last committed token"
            )
    siblings = set()
    for parent, token in zip(parents, tokens):
        if (parent, token) in siblings:
            raise InvalidArgument(f"draft_parents: token {token} appears twice under the same parent ({parent})")
        siblings.add((parent, token))
    if block.draft_probs:
        raise InvalidArgument("a token tree (draft_parents) carries no draft_probs: its drafts are deterministic guesses")


def _check_sparse_q(
    position: int, draft_token: int, token_ids: Sequence[int], probs: Sequence[float], vocab_size: int
) -> None:
    where = f"draft_probs[{position}]"
    if len(token_ids) != len(probs):
        raise InvalidArgument(f"{where} has {len(token_ids)} token_ids but {len(probs)} probs")
    check_token_ids(f"{where}.token_ids", token_ids, vocab_size)
    if len(set(token_ids)) != len(token_ids):
        raise InvalidArgument(f"{where}.token_ids repeats a token")
    if any(math.isnan(p) or p < 0 or math.isinf(p) for p in probs):
        raise InvalidArgument(f"{where}.probs must be finite and >= 0")
    if abs(math.fsum(probs) - 1.0) > Q_SUM_TOLERANCE:
        raise InvalidArgument(f"{where}.probs sum to {math.fsum(probs):.6f}, not 1")
    q_draft = dict(zip(token_ids, probs)).get(draft_token, 0.0)
    if q_draft <= 0:
        raise InvalidArgument(
            f"{where} gives the draft token {draft_token} probability 0; a sampled token must be in q's support"
        )
