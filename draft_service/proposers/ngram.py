"""Prompt lookup (``ngram``): drafts by copying what followed an earlier occurrence of the suffix.

No model and no tokenizer: it works on token ids, so it pairs with any target. It pays off where
the output repeats the input (code edits, extraction, quoting). Its proposals are deterministic,
so blocks carry no q (the target treats q as one-hot), which keeps sampling exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from draft_service.proposers.base import Proposer, ProposerSession
from draft_service.types import LogitShaping, Proposal, SamplingParams

if TYPE_CHECKING:
    import torch

LOOKUP_SOURCE = "lookup"  # Proposal.sources: "lookup:N", copied after N agreeing tokens (match_bucket)


def find_match(tokens: np.ndarray, ngram_max: int, ngram_min: int) -> tuple[int, int] | None:
    """(where the copied continuation starts, the length n of the matched suffix), or None when no
    suffix n-gram recurs.

    Takes the longest suffix that recurs (n = ngram_max down to ngram_min) and, for that n, its
    most recent earlier occurrence: longer and more recent matches predict the continuation better.
    Every occurrence ends at an earlier copy of the last token, so only those positions are
    checked, backwards, one token of the suffix at a time (a few vector operations over the
    candidates, not one over the whole sequence per n). tokens: [seq] int64.
    """
    seq = tokens.shape[0]
    longest = min(ngram_max, seq - 1)
    if longest < ngram_min or longest < 1:
        return None
    # An occurrence of the n-token suffix ends at some e <= seq - 2 (a token must follow it).
    ends = np.flatnonzero(tokens[: seq - 1] == tokens[seq - 1])  # [c] candidate ends, ascending
    if not ends.size:
        return None
    agree = np.ones(ends.shape[0], dtype=np.int64)  # [c] suffix tokens each candidate matches so far
    alive = np.ones(ends.shape[0], dtype=bool)  # [c] still matching
    for back in range(1, longest):
        prior = ends - back  # [c]
        alive &= prior >= 0
        alive[alive] = tokens[prior[alive]] == tokens[seq - 1 - back]
        agree += alive
        if not alive.any():
            break
    best = int(agree.max())
    if best < ngram_min:
        return None
    end = int(ends[np.flatnonzero(agree == best)[-1]])  # the most recent of the longest
    return end + 1, best


def agreeing_run(tokens: np.ndarray, start: int, n: int, limit: int = 64) -> int:
    """How far back (up to ``limit``) the copied span's context agrees with the sequence's end:
    at least the match length ``n`` (lookup matches at most ``ngram_max`` tokens, but a copy that
    has been right for thirty tokens is a safer bet than one that matched four just now)."""
    seq = tokens.shape[0]
    run = n
    while run < limit and start - run - 1 >= 0 and tokens[start - run - 1] == tokens[seq - run - 1]:
        run += 1
    return run


def match_bucket(run: int) -> int:
    """The source bucket of an agreeing run: 1, 2, 3, then 4, 8, 16 for runs from there on."""
    for bucket in (16, 8, 4):
        if run >= bucket:
            return bucket
    return run


def find_continuation(tokens: np.ndarray, ngram_max: int, ngram_min: int) -> int | None:
    """Where the copied continuation starts (``find_match``), or None."""
    match = find_match(tokens, ngram_max, ngram_min)
    return None if match is None else match[0]


class NgramSession(ProposerSession):
    def __init__(self, token_ids: Sequence[int], ngram_max: int, ngram_min: int) -> None:
        self._tokens = np.asarray(token_ids, dtype=np.int64)  # [seq] the committed sequence
        self._ngram_max = ngram_max
        self._ngram_min = ngram_min

    def propose(self, max_tokens: int) -> Proposal:
        return self.lookup(max_tokens)[0]

    def lookup(self, max_tokens: int, after: Sequence[int] = (), ngram_min: int = 0) -> tuple[Proposal, int]:
        """The proposal and the length of the suffix match it copies from (0: no draft).

        ``after``: drafts assumed to follow the committed sequence (the lookup continues them);
        ``ngram_min``: a shortest match other than the session's own.
        """
        if max_tokens <= 0:
            return Proposal(), 0
        tokens = self._tokens if not after else np.concatenate([self._tokens, np.asarray(after, dtype=np.int64)])
        match = find_match(tokens, self._ngram_max, max(ngram_min, self._ngram_min))
        if match is None:
            # No draft: the round still commits the target's next token, like a Generate step.
            return Proposal(), 0
        start, n = match
        # The copied span may run into the end of the sequence (the match overlaps the suffix, as
        # in repetitive text); it then continues with the tokens it proposes itself, i.e. the
        # span repeats with period len - start.
        continuation = np.resize(tokens[start:], max_tokens)  # [max_tokens]
        source = f"{LOOKUP_SOURCE}:{match_bucket(agreeing_run(tokens, start, n))}"
        return Proposal(tuple(int(t) for t in continuation), sources=(source,) * max_tokens), n

    def commit(self, base_len: int, token_ids: Sequence[int], hidden_states: torch.Tensor | None = None) -> None:
        if not 0 <= base_len <= self._tokens.shape[0]:
            raise ValueError(f"base_len {base_len} outside the committed sequence of {self._tokens.shape[0]}")
        self._tokens = np.concatenate([self._tokens[:base_len], np.asarray(token_ids, dtype=np.int64)])

    def close(self) -> None:
        self._tokens = np.zeros(0, dtype=np.int64)


class NgramProposer(Proposer):
    kind = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min ({ngram_min}) <= ngram_max ({ngram_max})")
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def new_session(self, token_ids: Sequence[int], sampling: SamplingParams,
                    shaping: LogitShaping | None = None) -> NgramSession:
        return NgramSession(token_ids, self.ngram_max, self.ngram_min)
