"""Prompt lookup first, the eagle head where lookup finds nothing (``ngram+eagle``).

The two drafters fail in different places. Prompt lookup is free and long-sighted where the
output repeats its context (JSON keys, code identifiers, quoted text) but has no draft at all
elsewhere, and then the round is a plain decode step. The eagle head drafts anywhere, at a few
milliseconds a step and with shorter accepted runs. So each round asks lookup first and falls
back to the head when lookup has no match, or only a weak one the head confidently disagrees with
(``_head_overrules``). It is the default draft for a target tandem
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

from draft_service.block_length import AcceptancePrior
from draft_service.proposers.base import Proposer, ProposerSession
from draft_service.proposers.eagle import EagleProposer, EagleSession
from draft_service.proposers.ngram import LOOKUP_SOURCE, NgramProposer, NgramSession
from draft_service.types import Proposal, SamplingConfig, SparseDist

if TYPE_CHECKING:
    import torch

COPY_SOURCE = "copy"  # Proposal.sources: lookup's continuation of the head's drafts


class NgramFirstSession(ProposerSession):
    def __init__(
        self, ngram: NgramSession, eagle: EagleSession, head_k: int = 0, overrule_confidence: float = 0.0
    ) -> None:
        self._ngram = ngram
        self._eagle = eagle
        self._head_k = head_k  # most drafts a head block makes (0 = the block's own K)
        self._overrule_confidence = overrule_confidence  # 0 = lookup drafts whenever it matches
        self.lookups = 0  # blocks drafted by prompt lookup
        self.head_drafts = 0  # blocks drafted by the eagle head
        self.overruled = 0  # of those, blocks where lookup had a draft the head overruled
        self.continued = 0  # head blocks that lookup continued

    def propose(self, max_tokens: int) -> Proposal:
        proposal, match_len = self._ngram.lookup(max_tokens)
        if proposal.token_ids:
            if not self._head_overrules(proposal.token_ids[0], match_len):
                self.lookups += 1
                return proposal
            self.overruled += 1
        proposal = self._eagle.propose(min(max_tokens, self._head_k) if self._head_k else max_tokens)
        if proposal.token_ids:
            self.head_drafts += 1
            proposal = self._continued_by_lookup(proposal, max_tokens)
        return proposal

    def _continued_by_lookup(self, proposal: Proposal, max_tokens: int) -> Proposal:
        """The head's block, filled up to ``max_tokens`` with what lookup copies after it.

        The head drafts a few tokens; where they end on a recurring span (at least two tokens, so
        the head's last guess is not the only evidence), the rest of the block costs nothing to
        draft: the head names the next JSON key, lookup copies the line it starts. Lookup's tokens
        are deterministic given the block before them, so their q is one-hot and sampled blocks
        stay exact. In ``benchmarks/draft_replay.py`` (K=7): json 3.44 -> 3.55x (4.20 -> 4.42
        tokens a round), code 2.39 -> 2.44 tokens a round at the same speed (wider passes).
        """
        room = max_tokens - len(proposal.token_ids)
        if room <= 0:
            return proposal
        copied = self._ngram.lookup(room, after=proposal.token_ids, ngram_min=2)[0]
        if not copied.token_ids:
            return proposal
        self.continued += 1
        one_hot = tuple(SparseDist((t,), (1.0,)) for t in copied.token_ids)
        probs = (proposal.probs + one_hot) if proposal.probs else ()  # greedy blocks carry no q
        # "copy:N" apart from "lookup:N": a span copied after guesses is a weaker bet than one after
        # committed tokens.
        sources = proposal.sources + tuple(s.replace(LOOKUP_SOURCE, COPY_SOURCE, 1) for s in copied.sources)
        return Proposal(proposal.token_ids + copied.token_ids, probs, sources if proposal.sources else ())

    def _head_overrules(self, lookup_first: int, match_len: int) -> bool:
        """Whether a lookup block copied after a one-token match gives way to the head.

        One recurring token is weak evidence: on the code bench prompts such blocks had their
        first draft rejected half the time (0.14 after a 4-token match), and each costs a pass over
        K+1 rows. When the head's own next token differs and the head gives it at least
        ``overrule_confidence``, its block is the better bet, and it starts from the step taken to
        judge (a step wasted only where lookup's block stands). At 0.3 (K=7, eagle_k 3): code 2.03 -> 2.08x
        in ``benchmarks/draft_replay.py`` (2.34 -> 2.39 tokens a round), and a mean accepted length
        of 2.44 against 2.38 live (``tandem bench``, two runs each); 0.5 and 0.7 gained less, and
        overruling matches of two tokens lost on math.
        """
        if match_len > 1 or self._overrule_confidence <= 0:
            return False
        guess = self._eagle.first_draft()
        return guess is not None and guess[0] != lookup_first and guess[1] >= self._overrule_confidence

    def commit(self, base_len: int, token_ids: Sequence[int], hidden_states: torch.Tensor | None = None) -> None:
        self._ngram.commit(base_len, token_ids)
        self._eagle.commit(base_len, token_ids, hidden_states)

    def close(self) -> None:
        self._ngram.close()
        self._eagle.close()


class NgramFirstProposer(Proposer):
    kind = "ngram+eagle"

    def __init__(
        self, ngram: NgramProposer, eagle: EagleProposer, head_k: int = 0, overrule_confidence: float = 0.0
    ) -> None:
        if head_k < 0:
            raise ValueError(f"head_k must be >= 0, got {head_k}")
        if not 0.0 <= overrule_confidence <= 1.0:
            raise ValueError(f"overrule_confidence must be in [0, 1], got {overrule_confidence}")
        self.ngram = ngram
        self.eagle = eagle
        self.head_k = head_k
        self.overrule_confidence = overrule_confidence

    @property
    def model_name(self) -> str:
        return self.eagle.model_name

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.eagle.tokenizer_fingerprint

    @property
    def wants_hidden_states(self) -> bool:
        return True

    @property
    def acceptance_prior(self) -> AcceptancePrior | None:
        """The head's: it was measured with lookup drafting beside the head (lookup and copy sources too)."""
        return self.eagle.acceptance_prior

    def new_session(self, token_ids: Sequence[int], sampling: SamplingConfig) -> NgramFirstSession:
        return NgramFirstSession(
            self.ngram.new_session(token_ids, sampling),
            self.eagle.new_session(token_ids, sampling),
            self.head_k,
            self.overrule_confidence,
        )

    def warm_up(self) -> None:
        self.ngram.warm_up()
        self.eagle.warm_up()
