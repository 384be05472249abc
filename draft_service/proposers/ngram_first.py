"""Prompt lookup first, the eagle head where lookup finds nothing (``ngram+eagle``).

The two drafters fail in different places. Prompt lookup is free and long-sighted where the
output repeats its context (JSON keys, code identifiers, quoted text) but has no draft at all
elsewhere, and then the round is a plain decode step. The eagle head drafts anywhere, at a few
milliseconds a step and with shorter accepted runs. So each round asks lookup first and falls
back to the head only when lookup has no match. It is the default draft for a target tandem
ships a head for: on the 24 bench prompts (``tandem bench``, 2-core CPU, one run each) 1.74x of
autoregressive decoding against 1.63x for lookup alone, ahead on every domain but json (a tie).

Both sub-sessions see every commit, so the head always has the current feature: every block asks
for hidden states, whoever drafted it. Which drafter runs is decided from the committed tokens
only, and each block carries the q of the drafter that made it (one-hot for lookup, the head's
sparse q when sampling), so rejection sampling stays exact.

The head drafts at most ``head_k`` tokens a block (``--eagle-k``, default 3), fewer than lookup's
K (default 7), and stops early where it doubts its own draft (``--eagle-min-confidence``, default
0.5). Its deeper drafts are accepted less often (0.74, 0.52, 0.38 by depth on held-out text for
the shipped head). While a 4-token verification cost 39 ms against 36 ms for one on a CPU, one
head draft was best; now that passes over up to 8 tokens cost little more than one
(``tandem.cpu_linear``), three are (measured in ``tandem.config`` beside ``DEFAULT_K``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from draft_service.proposers.base import Proposer, ProposerSession
from draft_service.proposers.eagle import EagleProposer, EagleSession
from draft_service.proposers.ngram import NgramProposer, NgramSession
from draft_service.types import Proposal, SamplingConfig

if TYPE_CHECKING:
    import torch


class NgramFirstSession(ProposerSession):
    def __init__(self, ngram: NgramSession, eagle: EagleSession, head_k: int = 0) -> None:
        self._ngram = ngram
        self._eagle = eagle
        self._head_k = head_k  # most drafts a head block makes (0 = the block's own K)
        self.lookups = 0  # blocks drafted by prompt lookup
        self.head_drafts = 0  # blocks drafted by the eagle head

    def propose(self, max_tokens: int) -> Proposal:
        proposal = self._ngram.propose(max_tokens)
        if proposal.token_ids:
            self.lookups += 1
            return proposal
        proposal = self._eagle.propose(min(max_tokens, self._head_k) if self._head_k else max_tokens)
        if proposal.token_ids:
            self.head_drafts += 1
        return proposal

    def commit(self, base_len: int, token_ids: Sequence[int], hidden_states: torch.Tensor | None = None) -> None:
        self._ngram.commit(base_len, token_ids)
        self._eagle.commit(base_len, token_ids, hidden_states)

    def close(self) -> None:
        self._ngram.close()
        self._eagle.close()


class NgramFirstProposer(Proposer):
    kind = "ngram+eagle"

    def __init__(self, ngram: NgramProposer, eagle: EagleProposer, head_k: int = 0) -> None:
        if head_k < 0:
            raise ValueError(f"head_k must be >= 0, got {head_k}")
        self.ngram = ngram
        self.eagle = eagle
        self.head_k = head_k

    @property
    def model_name(self) -> str:
        return self.eagle.model_name

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.eagle.tokenizer_fingerprint

    @property
    def wants_hidden_states(self) -> bool:
        return True

    def new_session(self, token_ids: Sequence[int], sampling: SamplingConfig) -> NgramFirstSession:
        return NgramFirstSession(
            self.ngram.new_session(token_ids, sampling), self.eagle.new_session(token_ids, sampling), self.head_k
        )

    def warm_up(self) -> None:
        self.ngram.warm_up()
        self.eagle.warm_up()
