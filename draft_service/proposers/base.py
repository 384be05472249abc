"""The proposer interface: what the speculation loop needs from a drafter.

A ``Proposer`` is the service-wide part (a loaded model, settings); it opens one
``ProposerSession`` per Speculate call, which owns that session's state (a KV cache, an n-gram
view of the tokens) and keeps it equal to the target's committed sequence. Sessions are only ever
touched from the draft's single model thread, so they need no locking.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from draft_service.block_length import AcceptancePrior
from draft_service.block_shape import BlockShapes
from draft_service.types import LogitShaping, Proposal, SamplingParams

if TYPE_CHECKING:
    import torch

# Small ids exist in every vocabulary; enough tokens to exercise a cache and an n-gram match.
WARMUP_TOKENS = (1, 2, 3, 4, 1, 2, 3)


class ProposerSession(ABC):
    """One session's drafting state."""

    @abstractmethod
    def propose(self, max_tokens: int) -> Proposal:
        """Drafts up to ``max_tokens`` tokens continuing the committed sequence (may be fewer)."""

    @abstractmethod
    def commit(self, base_len: int, token_ids: Sequence[int], hidden_states: torch.Tensor | None = None) -> None:
        """The committed sequence is now ``committed[:base_len] + token_ids``.

        Called after every verdict: rolls back whatever the last proposal assumed beyond what the
        target accepted, then takes the newly committed tokens. ``hidden_states`` ([len(token_ids),
        hidden] float32) comes with the verdict when the proposer ``wants_hidden_states``: row i is
        the target's final hidden state at the position whose logits produced ``token_ids[i]``.
        Proposers that do not want them ignore it.
        """

    def next_tokens(self, n: int) -> tuple[int, ...]:
        """Up to ``n`` tokens the proposer expects after the committed sequence, most likely first
        (guesses for blocks sent ahead of a verdict; greedy and sampled alike). This default offers
        the first token of a one-token proposal."""
        return self.propose(1).token_ids[:1] if n > 0 else ()

    @abstractmethod
    def close(self) -> None:
        """Frees the session's state early (KV cache tensors) instead of waiting for the GC."""


class Proposer(ABC):
    """A drafter shared by all sessions of the service."""

    #: "hf", "ngram", ... (DraftService.Info.proposer)
    kind: str = ""

    @property
    def model_name(self) -> str:
        """The draft model's name; empty for model-free proposers."""
        return ""

    @property
    def wants_hidden_states(self) -> bool:
        """Whether verdicts must carry the target's hidden states (the loop then asks for them in
        every block): feature-conditioned proposers draft from them."""
        return False

    @property
    def tokenizer_fingerprint(self) -> str:
        """``tandem.models.tokenizer_fingerprint`` of the draft's tokenizer; empty when the
        proposer works on token ids of any tokenizer."""
        return ""

    @property
    def acceptance_prior(self) -> AcceptancePrior | None:
        """How often this drafter's drafts are accepted, by source and depth, as measured where it
        was built (``draft_service.block_length``); None when nothing was measured."""
        return None

    @property
    def block_shape(self) -> str:
        """How its blocks are shaped, for the start-up log: "chains", or what trees it drafts."""
        return "chains"

    @property
    def block_shapes(self) -> BlockShapes | None:
        """Where it chooses between token trees and chains by measured rates, the tallies of its
        greedy sessions, which the speculation loops report verified rounds of a chosen shape to
        (``Proposal.shape``)."""
        return None

    def shapes_for(self, sampling: SamplingParams) -> BlockShapes | None:
        """The shape tallies of sessions that decode with ``sampling`` (``block_shapes`` for
        greedy ones): greedy and sampled rounds commit at rates too different to share one."""
        return self.block_shapes if sampling.greedy else None

    @abstractmethod
    def new_session(self, token_ids: Sequence[int], sampling: SamplingParams,
                    shaping: LogitShaping | None = None) -> ProposerSession:
        """Opens drafting state for a committed sequence (cheap: heavy work happens in propose).
        ``shaping``: the target's penalties and bias, for a drafter that scores logits to follow."""

    def warm_up(self) -> None:
        """Runs one short session so lazy initialisation is paid before health says SERVING."""
        session = self.new_session(WARMUP_TOKENS, SamplingParams())
        try:
            proposal = session.propose(4)
            session.commit(len(WARMUP_TOKENS), (*proposal.token_ids[:1], WARMUP_TOKENS[0]))
            session.propose(4)
        finally:
            session.close()
