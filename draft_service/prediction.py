"""Drafts from a predicted output (OpenAI's ``prediction``): the text the answer is expected to repeat.

A client that edits code, or fills a template, knows most of the answer before it is written: the
unchanged lines. It sends them as the request's prediction, and a :class:`PredictedSession` wraps the
session's drafter: while the output follows the prediction, it proposes the prediction's next
tokens; where the output leaves it (an edited line), the inner drafter proposes until the output's
last tokens are found in the prediction again, and copying resumes after them. The target verifies
every draft as any other, so the answer is the target's with or without a prediction; only the
number of rounds changes.

Drafts copied from the prediction are named ``prediction:N`` for the block-length policy
(``draft_service.block_length``), N bucketed like lookup's (``match_bucket``): the number of the
output's last tokens that agree with the prediction before the copied span; until they are counted,
they are priced as lookup's copies after as many tokens (:func:`with_prediction_prior`). Where the
inner drafter is prompt lookup copying after at least as long an agreeing run (the prediction is
often in the prompt too: the code an edit is asked for), its copy is taken instead.

Invariant: ``_at`` is None or an index into the prediction such that the output's last
``_agree`` tokens are ``prediction[_at - _agree:_at]`` (the output from ``start`` on being the
session's tokens as ``commit`` says).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from draft_service.block_length import AcceptancePrior
from draft_service.proposers.base import ProposerSession
from draft_service.proposers.ngram import LOOKUP_SOURCE, match_bucket
from draft_service.types import Proposal

SOURCE = "prediction"
REALIGN_TOKENS = 4  # the longest suffix of the output looked for in the prediction to copy after it
MAX_AGREE = 64  # an agreeing run is counted up to this many tokens
TOP_BUCKET = match_bucket(MAX_AGREE)  # past it no lookup copy follows a longer run: the drafter is not asked


def _lookup_bucket(proposal: Proposal) -> int:
    """The agreeing-run bucket of a proposal that prompt lookup made (``lookup:N``); 0 for any other."""
    first = proposal.sources[0] if proposal.sources else ""
    kind, _, bucket = first.partition(":")
    return int(bucket) if kind == LOOKUP_SOURCE and bucket.isdigit() else 0


def with_prediction_prior(prior: AcceptancePrior | None) -> AcceptancePrior | None:
    """A drafter's measured acceptance with each lookup rate also standing for the prediction's
    drafts after as many agreeing tokens (both copy a span whose context agrees with the output's
    end), so the block-length policy does not cut a prediction's first copies to a coin flip each
    while it learns their own rate."""
    if not prior:
        return prior
    copied = {(f"{SOURCE}:{source.partition(':')[2]}", depth): rate for (source, depth), rate in prior.items()
              if source.startswith(f"{LOOKUP_SOURCE}:")}
    return {**copied, **prior}


def is_predicted(source: str) -> bool:
    """Whether a draft's source (as ``Proposal.sources`` names it) is the prediction."""
    return source.split("/")[-1].startswith(SOURCE)


class PredictedSession(ProposerSession):
    """A proposer session that drafts from the prediction where the output follows it."""

    def __init__(self, inner: ProposerSession, prediction: Sequence[int], start: int, token_ids: Sequence[int]) -> None:
        self.inner = inner
        self._prediction = np.asarray(prediction, dtype=np.int64)  # [p]
        self._start = start  # where the output begins in the session's sequence
        self._output: list[int] = []
        self._at: int | None = 0  # the prediction's next token, if the output is aligned with it
        self._agree = 0
        self._reached = 0  # the furthest the output has followed the prediction to
        self._follow(list(token_ids[start:]))

    def propose(self, max_tokens: int) -> Proposal:
        copied = self._copy(max_tokens)
        if not copied:
            return self.inner.propose(max_tokens)
        bucket = match_bucket(self._agree)
        if bucket < TOP_BUCKET:  # a lookup copy could follow a longer run: the drafter is asked (its work)
            inner = self.inner.propose(max_tokens)
            if _lookup_bucket(inner) >= max(bucket, 1):  # the drafter copies after as long a run: its copy
                return inner
        return Proposal(token_ids=copied, sources=(f"{SOURCE}:{bucket}",) * len(copied))

    def commit(self, base_len: int, token_ids: Sequence[int], hidden_states: Any = None) -> None:
        self.inner.commit(base_len, token_ids, hidden_states)
        self._follow(self._output[: max(0, base_len - self._start)] + list(token_ids))

    def next_tokens(self, n: int) -> tuple[int, ...]:
        copied = self._copy(n)
        return copied[:n] if copied else self.inner.next_tokens(n)

    def close(self) -> None:
        self.inner.close()

    # ------------------------------------------------------------------------------ internals

    def _copy(self, max_tokens: int) -> tuple[int, ...]:
        if self._at is None or max_tokens <= 0:
            return ()
        return tuple(int(t) for t in self._prediction[self._at:self._at + max_tokens])

    def _follow(self, output: list[int]) -> None:
        """The output is now ``output``: step along the prediction while it agrees, else look for
        the output's last tokens in it."""
        kept = 0
        while kept < min(len(self._output), len(output)) and self._output[kept] == output[kept]:
            kept += 1
        if kept < len(self._output):  # rolled back: align afresh
            self._output, self._at, self._agree = output, None, 0
            self._realign()
            return
        for token in output[kept:]:
            self._output.append(token)
            if self._at is not None and self._at < len(self._prediction) and self._prediction[self._at] == token:
                self._at += 1
                self._agree = min(self._agree + 1, MAX_AGREE)
                self._reached = max(self._reached, self._at)
            else:
                self._at, self._agree = None, 0
        if self._at is None:
            self._realign()

    def _realign(self) -> None:
        """Aligns after an occurrence in the prediction of the output's longest suffix (up to
        REALIGN_TOKENS tokens) found there: the first one past the furthest point the output has
        reached in it (an edit moves on through its text), else the last one; the prediction's
        start while the output is empty."""
        if not self._output:
            self._at, self._agree = 0, 0
            return
        for n in range(min(REALIGN_TOKENS, len(self._output), self._prediction.shape[0]), 0, -1):
            tail = np.asarray(self._output[-n:], dtype=np.int64)  # [n]
            windows = np.lib.stride_tricks.sliding_window_view(self._prediction, n)  # [p - n + 1, n]
            ends = np.flatnonzero((windows == tail).all(axis=1)) + n  # [m] where a copy would resume
            if ends.size:
                ahead = ends[ends >= self._reached]
                self._at = int(ahead[0] if ahead.size else ends[-1])
                self._agree = n
                self._reached = max(self._reached, self._at)
                return
