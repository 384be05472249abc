"""Plain dataclasses the draft service works with; protobuf appears only in ``wire.py``.

Keeping the loop, the proposers and the engine free of generated message classes lets tests drive
them with ordinary values and keeps wire details (field presence, enum numbering) in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.rpc.token_tree import depths

# Shared with the target and the gateway: one class per meaning (tandem.rpc.types).
from tandem.rpc.types import (  # noqa: F401 (Verdict, VerdictStatus: re-exported for the draft's modules)
    DraftBlock,
    FinishReason,
    Grammar,
    SamplingParams,
    SparseDist,
    TokenLogprob,
    Verdict,
    VerdictStatus,
)


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one block, and q per position when the proposer sampled them.

    ``probs`` is empty for deterministic proposals (greedy or prompt lookup): the target then
    treats q as one-hot on the draft token. ``sources`` (empty when the proposer does not say)
    names what drafted each token and how sure it was, e.g. ``lookup:2`` or ``head:0.7``: the
    keys under which ``draft_service.block_length`` learns how often such drafts are accepted.
    They stay in the draft service; the block sent to the target carries tokens and q only.
    """

    token_ids: tuple[int, ...] = ()
    probs: tuple[SparseDist, ...] = ()
    sources: tuple[str, ...] = ()
    # A token tree (its drafts are deterministic guesses: no probs): the parent of each draft, an
    # earlier index or -1 for the last committed token. Empty: a chain.
    parents: tuple[int, ...] = ()
    # "tree" or "chain" where the draft service chose this block's shape from measured rates
    # (draft_service.block_shape), which the verdict then reports back to; "" where nothing was chosen.
    shape: str = ""

    def __post_init__(self) -> None:
        if self.parents:
            if len(self.parents) != len(self.token_ids):
                raise ValueError(f"{len(self.parents)} parents for {len(self.token_ids)} draft tokens")
            if any(not -1 <= parent < i for i, parent in enumerate(self.parents)):
                raise ValueError(f"tree parents must name an earlier draft or -1, got {list(self.parents)}")
            if self.probs:
                raise ValueError("a token tree carries no q: its drafts are deterministic guesses")
        if self.probs and len(self.probs) != len(self.token_ids):
            raise ValueError(f"{len(self.probs)} distributions for {len(self.token_ids)} draft tokens")
        if self.sources and len(self.sources) != len(self.token_ids):
            raise ValueError(f"{len(self.sources)} sources for {len(self.token_ids)} draft tokens")

    @property
    def positions(self) -> int:
        """The most drafts the target could accept: the length of a chain, the deepest root
        path of a tree (a tree of 5 nodes may offer only 3)."""
        return max(depths(self.parents)) if self.parents else len(self.token_ids)

    def likely_path(self) -> tuple[int, ...]:
        """The drafts a block is most likely to have accepted whole: a chain's tokens, or the root
        path of a tree that takes each node's first child. Trees are grown best-first (a node's
        first child is its most probable one) and siblings follow their parent in the block."""
        return self.outcomes()[0][0]

    def outcomes(self) -> list[tuple[tuple[int, ...], frozenset[int] | None]]:
        """Where a verdict on this block is likely to leave the sequence, most likely first, for
        blocks sent ahead of it: (the drafts accepted, the tokens the target's own next token cannot
        be). First the whole likely path followed by a bonus token (None: any token), then a
        rejection at each node of that path from the root: the target's token is then none of the
        node's children, which it would have accepted."""
        path, nodes, node = [], [-1], -1
        parents = self.parents or tuple(range(-1, len(self.token_ids) - 1))
        for index, parent in enumerate(parents):
            if parent == node:
                path.append(self.token_ids[index])
                node = index
                nodes.append(index)
        outcomes: list[tuple[tuple[int, ...], frozenset[int] | None]] = [(tuple(path), None)]
        for depth, at in enumerate(nodes[:-1]):
            children = frozenset(self.token_ids[i] for i, parent in enumerate(parents) if parent == at)
            outcomes.append((tuple(path[:depth]), children))
        return outcomes

    def below_first(self) -> Proposal:
        """The drafts after the first: a chain's tail, or the subtree under a tree's first node
        (its children become roots). What a block carries when the first draft is a guess taken as
        committed instead of sent."""
        if not self.token_ids:
            return self
        if not self.parents:
            return Proposal(self.token_ids[1:], self.probs[1:], self.sources[1:])
        index_of = {0: -1}  # node -> its index in the subtree (node 0 -> the root)
        tokens, parents, sources = [], [], []
        for node in range(1, len(self.token_ids)):
            if self.parents[node] in index_of:
                index_of[node] = len(tokens)
                tokens.append(self.token_ids[node])
                parents.append(index_of[self.parents[node]])
                if self.sources:
                    sources.append(self.sources[node])
        return Proposal(tuple(tokens), sources=tuple(sources), parents=tuple(parents))

    def cut(self, length: int) -> Proposal:
        """The first ``length`` drafts (with their q and sources); of a tree, its first ``length``
        nodes, itself a tree (a node's parent comes before it) of the most probable ones where the
        tree was grown best-first."""
        if length >= len(self.token_ids):
            return self
        return Proposal(self.token_ids[:length], self.probs[:length], self.sources[:length], self.parents[:length],
                        self.shape)


@dataclass(frozen=True)
class LogitShaping:
    """What a session's target does to its logits that the head should do too (``active`` where it
    does anything)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    # Where the generated text begins in the committed sequence (the prompt's length, less the
    # tokens a moved session continues): the presence and frequency penalties count from there.
    generated_from: int = 0

    @property
    def active(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0 or bool(self.bias)


@dataclass(frozen=True)
class SessionSpec:
    """A validated Speculate request: what one speculation loop runs."""

    session_id: str
    token_ids: tuple[int, ...]  # the committed sequence: prompt + tokens generated so far
    prompt_len: int
    sampling: SamplingParams
    num_speculative_tokens: int  # K, already resolved from the service default
    session_max_new_tokens: int = 0  # the target session's budget incl. the prefill token; 0 = none
    max_new_tokens: int = 0  # the call ends after the round that streams this many in all; 0 = with the session
    tokenizer_fingerprint: str = ""  # the caller's; empty = not checked
    target_address: str = ""  # the target holding the session ("host:port" of the draft's pool); "" = its first
    grammar: Grammar | None = None  # a constrained session's grammar: its drafts follow it (draft_service.guide)
    continued_tokens: int = 0  # the prompt's last tokens that are the session's output so far (a moved session)
    prediction_token_ids: tuple[int, ...] = ()  # a predicted output to draft from (draft_service.prediction)
    # The target's penalties and bias, which the head's logits follow (draft_service.proposers.shaping).
    shaping: LogitShaping | None = None


@dataclass(frozen=True)
class ProposedBlock:
    """A proposal on its way to the target: the :class:`DraftBlock` it is sent as (:meth:`block`),
    with the proposal itself kept whole (its sources stay in the draft service).

    ``assumed_token_ids``: tokens after the first ``base_len`` that the block takes as committed
    though no verdict said so yet (a block sent before the verdict of the one before it); the
    target verifies it only if they are exactly what it committed, and answers STALE otherwise."""

    session_id: str
    block_id: int
    base_len: int
    proposal: Proposal
    tokenizer_fingerprint: str = ""
    # Ask the target for this block's hidden states (feature-conditioned proposers).
    return_hidden_states: bool = False
    assumed_token_ids: tuple[int, ...] = ()

    def block(self) -> DraftBlock:
        proposal = self.proposal
        return DraftBlock(
            session_id=self.session_id,
            base_len=self.base_len,
            draft_token_ids=proposal.token_ids,
            draft_probs=proposal.probs,
            block_id=self.block_id,
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            return_hidden_states=self.return_hidden_states,
            draft_parents=proposal.parents,
            assumed_token_ids=self.assumed_token_ids,
        )


@dataclass(frozen=True)
class RoundResult:
    """What one speculation round streams to the caller (one SpeculateResponse)."""

    token_ids: tuple[int, ...]
    committed_len: int
    finish_reason: FinishReason
    num_draft_tokens: int
    num_accepted: int
    round_seconds: float
    verify_seconds: float
    verified: bool = True  # False for the closing result of a FINISHED verdict (no block verified)
    num_draft_positions: int = 0  # the block's Proposal.positions (num_draft_tokens for a chain)
    propose_seconds: float = 0.0  # of round_seconds: the proposer's work (model-thread hop included)
    exchange_seconds: float = 0.0  # of round_seconds: the Verify round trip (verify_seconds within it)
    step_seconds: float = 0.0  # the verdict's (Verdict.step_seconds), for the gateway
    logprobs: tuple[TokenLogprob, ...] = ()  # the verdict's, one per token (when the session asked)
    # Of num_draft_tokens, those copied from the prediction; of num_accepted, those of them accepted.
    num_prediction_drafts: int = 0
    num_prediction_accepted: int = 0


@dataclass(frozen=True)
class TargetInfo:
    """The facts about the target the draft relies on (from ``TargetService.Info``)."""

    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_context_len: int = 0  # 0 = unknown
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    hidden_size: int = 0  # 0 = unknown
