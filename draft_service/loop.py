"""The speculation loop of one session, free of sockets: propose, verify, roll back, repeat.

It talks to the target through ``BlockVerifier`` (the gRPC Verify stream in production, an
in-memory reference target in tests) and to the proposer through ``run_model``, which runs model
work on the draft's model thread. This loop is synchronous: block n+1 is proposed after verdict n,
so its blocks never assume uncommitted tokens and a STALE verdict signals a bug somewhere
(``draft_service.pipeline`` keeps blocks in flight, ``--pipeline-depth``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from draft_service.block_length import AcceptanceTally, BlockLengthPolicy
from draft_service.block_shape import BlockShapes
from draft_service.errors import DivergedError, ProtocolError
from draft_service.hop import HopStats
from draft_service.prediction import is_predicted
from draft_service.proposers.base import ProposerSession
from draft_service.types import FinishReason, Proposal, ProposedBlock, RoundResult, SessionSpec, Verdict, VerdictStatus

if TYPE_CHECKING:
    import torch

# Runs fn(*args) on the draft's model thread (``ModelWorker.run``).
RunModel = Callable[..., Awaitable[Any]]

# A verdict for the proposer session: (base_len, committed tokens, their hidden states [n, hidden] or None).
PendingCommit = tuple[int, Sequence[int], "torch.Tensor | None"]

# Consecutive STALE verdicts at an unchanged committed length before the loop gives up.
MAX_STALE_RETRIES = 3


def root_path_length(proposal: Proposal, tokens: Sequence[int]) -> int:
    """How many of ``tokens`` the proposal drafted in a row from the last committed token: the
    longest prefix of ``tokens`` that is a path from the root of its tree (of a chain: its prefix)."""
    return len(root_path(proposal, tokens))


def root_path(proposal: Proposal, tokens: Sequence[int]) -> list[int]:
    """The drafts (indices, root first) of the longest prefix of ``tokens`` that is a path from the
    root of the proposal's tree (of a chain: its prefix).

    Siblings carry distinct tokens, so each token names at most one child to step to.
    """
    drafts = proposal.token_ids
    parents = proposal.parents or tuple(range(-1, len(drafts) - 1))
    path: list[int] = []
    node = -1
    for token in tokens:
        # Children follow their parent in the block.
        node = next((i for i in range(node + 1, len(drafts)) if parents[i] == node and drafts[i] == token), None)
        if node is None:
            break
        path.append(node)
    return path


def prediction_counts(proposal: Proposal, committed: Sequence[int], num_accepted: int) -> tuple[int, int]:
    """Of a verified block's drafts, those copied from the prediction (draft_service.prediction),
    and those of them on the accepted path."""
    drafted = [i for i, source in enumerate(proposal.sources) if is_predicted(source)]
    if not drafted:
        return 0, 0
    path = root_path(proposal, committed[:num_accepted])
    return len(drafted), sum(is_predicted(proposal.sources[i]) for i in path)


class BlockVerifier(Protocol):
    async def verify(self, block: ProposedBlock) -> Verdict:
        """Sends one block and returns its verdict."""
        ...


class PipelinedVerifier(BlockVerifier, Protocol):
    """A verifier that takes blocks before the verdicts of earlier ones: verdicts come back in the
    order the blocks went out, each judged against what the blocks before it committed (a block
    whose ``assumed_token_ids`` turned out wrong gets STALE)."""

    async def send(self, block: ProposedBlock) -> None: ...

    async def receive(self, block_id: int) -> Verdict: ...


class SpeculationLoop:
    """Runs one session's rounds and yields what each committed.

    The streamed tokens are exactly the target's committed tokens, in order: the loop only ever
    yields ``committed_token_ids`` of OK verdicts for blocks extending its current view.
    """

    def __init__(
        self,
        spec: SessionSpec,
        proposer: ProposerSession,
        verifier: BlockVerifier,
        run_model: RunModel,
        *,
        max_context_len: int = 0,
        tokenizer_fingerprint: str = "",
        want_hidden_states: bool = False,
        pending_commit: PendingCommit | None = None,
        lengths: BlockLengthPolicy | None = None,
        acceptance: AcceptanceTally | None = None,
        clock: Callable[[], float] = time.perf_counter,
        hop: HopStats | None = None,
        shapes: BlockShapes | None = None,
    ) -> None:
        """``pending_commit``: a verdict the proposer session has not applied yet (a session resumed
        from an earlier call, ``pending_commit`` of that call's loop). ``lengths``: the service's
        policy that cuts proposals to the length that pays best, and learns from each verdict
        (None: every proposal is sent whole); ``acceptance``: the session's own record from an
        earlier call (a fresh one when None); ``hop``: the measured hop to the session's target
        (``draft_service.hop``), which the loop feeds and prices rounds with; ``shapes``: the
        proposer's measured choice of block shape (``Proposer.block_shapes``), told what each
        round of a chosen shape committed and took."""
        self._spec = spec
        self._proposer = proposer
        self._verifier = verifier
        self._run_model = run_model
        self._max_context_len = max_context_len
        self._fingerprint = tokenizer_fingerprint
        self._want_hidden_states = want_hidden_states
        self._clock = clock
        self._hop = hop
        self._lengths = lengths
        self._shapes = shapes
        self.acceptance = acceptance if acceptance is not None else AcceptanceTally()  # weighed in by ``lengths``
        # Sampled drafts are accepted by chance, greedy ones by agreement: tallied apart.
        self._source_prefix = "" if spec.sampling.greedy else "sampled/"
        self._committed_len = len(spec.token_ids)  # of the sequence as the target has it
        self._streamed = 0
        self._next_block_id = 0
        self._stale_in_a_row = 0
        # The proposer learns a verdict lazily, in the same model-thread call as the next proposal,
        # so the verdict's tokens are streamed without waiting for a thread hop.
        self._pending_commit = pending_commit

    @property
    def pending_commit(self) -> PendingCommit | None:
        """The last verdict, which the proposer session learns only with the next proposal."""
        return self._pending_commit

    async def rounds(self) -> AsyncIterator[RoundResult]:
        while not self._call_budget_spent():
            started = self._clock()
            base_len = self._committed_len
            proposal = await self._run_model(self._commit_and_propose, self._pending_commit, self._block_size())
            proposed = self._clock()
            proposal, sources = self._cut(proposal)
            self._pending_commit = (base_len, (), None)  # a refused block still has to be rolled back
            asked = self._clock()
            verdict = await self._verify(base_len, proposal)
            answered = self._clock()
            if verdict.status is VerdictStatus.STALE:
                self._on_stale(verdict)
                continue
            self._stale_in_a_row = 0
            if self._hop is not None:
                self._hop.observe_exchange(answered - asked, verdict.verify_seconds)
            if verdict.status is VerdictStatus.OK:
                self._learn(proposal, sources, verdict, seconds=answered - asked, propose_seconds=proposed - started)
            if verdict.status is VerdictStatus.FINISHED:
                yield RoundResult(
                    token_ids=(),
                    committed_len=verdict.committed_len or base_len,
                    finish_reason=verdict.finish_reason,
                    num_draft_tokens=0,
                    num_accepted=0,
                    round_seconds=self._clock() - started,
                    verify_seconds=verdict.verify_seconds,
                    verified=False,
                )
                return
            committed = self._check_ok(base_len, proposal, verdict)
            if self._shapes is not None and proposal.shape:
                self._shapes.observe(proposal.shape, len(committed), answered - started)
            self._pending_commit = (base_len, committed, verdict.hidden_states)
            self._committed_len += len(committed)
            self._streamed += len(committed)
            predicted, predicted_accepted = prediction_counts(proposal, committed, verdict.num_accepted)
            yield RoundResult(
                token_ids=committed,
                committed_len=verdict.committed_len,
                finish_reason=verdict.finish_reason,
                num_draft_tokens=len(proposal.token_ids),
                num_accepted=verdict.num_accepted,
                round_seconds=self._clock() - started,
                verify_seconds=verdict.verify_seconds,
                num_draft_positions=proposal.positions,
                propose_seconds=proposed - started,
                exchange_seconds=answered - asked,
                step_seconds=verdict.step_seconds,
                logprobs=verdict.logprobs,
                num_prediction_drafts=predicted,
                num_prediction_accepted=predicted_accepted,
            )
            if verdict.finish_reason is not FinishReason.NONE:
                return

    def _cut(self, proposal: Proposal) -> tuple[Proposal, tuple[str, ...]]:
        """The proposal cut where its round pays best (a chain to a length, a tree to its first
        nodes) and the sources of what is sent, as the policy tallies them; the proposal whole and
        no sources where there is no policy or the proposer names none."""
        if self._lengths is None or not proposal.sources:
            return proposal, ()
        sources = tuple(self._source_prefix + source for source in proposal.sources)
        cut = proposal.cut(self._lengths.length(sources, self.acceptance, self._transport_s(), parents=proposal.parents))
        return cut, sources[: len(cut.token_ids)]

    def _learn(self, proposal: Proposal, sources: Sequence[str], verdict: Verdict, seconds: float | None,
               propose_seconds: float) -> None:
        """Teaches the session's tally and the policy an OK ``verdict`` on ``proposal`` (``seconds``:
        the round trip, None where another block's pass was in it). Nothing without sources (``_cut``)."""
        if not sources or self._lengths is None:
            return
        num_accepted, committed = verdict.num_accepted, verdict.committed_token_ids
        path = root_path(proposal, committed[:num_accepted])
        self.acceptance.observe(sources, num_accepted, proposal.parents, path)
        self._lengths.observe(sources, num_accepted, rows=len(proposal.token_ids) + 1, seconds=seconds,
                              propose_seconds=propose_seconds, verify_seconds=verdict.verify_seconds,
                              parents=proposal.parents, path=path, pass_rows=verdict.pass_rows,
                              pass_tokens=verdict.pass_tokens, committed=len(committed))

    def _transport_s(self) -> float | None:
        """The measured round trip to the target beyond its pass (None before any)."""
        return self._hop.measured_transport_s if self._hop is not None else None

    def _block_size(self, length: int | None = None) -> int:
        """K, cut so the verdict cannot commit more than any known budget allows, for a block
        extending a sequence of ``length`` tokens (default: the committed one).

        A block of k draft tokens commits at most k + 1 tokens (the recovered or bonus token), so
        with b tokens left the block needs at most b - 1 drafts; drafting more wastes draft and
        target compute on tokens the target would truncate.

        The call's own ``max_new_tokens`` is no such budget: it ends the call after the round that
        reaches it (a gateway leg, after which the gateway may switch modes), and the session goes
        on. Cut for it, each leg's last round drafted a token or two instead of a full block, and
        ``speculation: "auto"`` ran measurably slower than ``"on"`` (figures:
        docs/fallback.md#fallback-floor, "Legs").
        """
        length = self._committed_len if length is None else length
        budgets = []
        if self._spec.session_max_new_tokens > 0:
            budgets.append(self._spec.session_max_new_tokens - (length - self._spec.prompt_len))
        if self._max_context_len > 0:
            budgets.append(self._max_context_len - length)
        k = self._spec.num_speculative_tokens
        return max(0, min(k, min(budgets) - 1)) if budgets else k

    def _call_budget_spent(self) -> bool:
        return 0 < self._spec.max_new_tokens <= self._streamed

    def _commit_and_propose(self, commit: PendingCommit | None, k: int) -> Proposal:
        """Runs on the model thread: apply the last verdict, then draft up to k tokens.

        An empty proposal still makes a block: the target then commits one token, like a decode
        step (and returns the hidden state that produced it, which is how a feature-conditioned
        proposer gets its first feature).
        """
        if commit is not None:
            self._proposer.commit(*commit)
        proposal = self._proposer.propose(k) if k > 0 else Proposal()
        if len(proposal.token_ids) > k:
            raise RuntimeError(f"proposer drafted {len(proposal.token_ids)} tokens, asked for at most {k}")
        return proposal

    async def _verify(self, base_len: int, proposal: Proposal) -> Verdict:
        block = ProposedBlock(
            session_id=self._spec.session_id,
            block_id=self._next_block_id,
            base_len=base_len,
            proposal=proposal,
            tokenizer_fingerprint=self._fingerprint,
            return_hidden_states=self._want_hidden_states,
        )
        self._next_block_id += 1
        verdict = await self._verifier.verify(block)
        if verdict.block_id != block.block_id:
            raise ProtocolError(f"verdict for block {verdict.block_id} arrived, block {block.block_id} expected")
        return verdict

    def _check_ok(self, base_len: int, proposal: Proposal, verdict: Verdict) -> tuple[int, ...]:
        """The committed tokens of an OK verdict, after checking it is consistent with the block."""
        committed = verdict.committed_token_ids
        accepted = verdict.num_accepted
        if verdict.committed_len != base_len + len(committed):
            raise ProtocolError(
                f"verdict says committed_len {verdict.committed_len} after committing {len(committed)} "
                f"tokens onto {base_len}"
            )
        if not 0 <= accepted <= min(len(proposal.token_ids), len(committed)) or (
            root_path_length(proposal, committed[:accepted]) != accepted
        ):
            shape = "a root path of the tree" if proposal.parents else "a prefix of the block"
            raise ProtocolError(f"verdict accepts {accepted} tokens that are not {shape}")
        if not committed and verdict.finish_reason is FinishReason.NONE:
            raise ProtocolError("verdict committed nothing and did not finish the session")
        if verdict.logprobs and len(verdict.logprobs) != len(committed):
            raise ProtocolError(f"verdict carries {len(verdict.logprobs)} log-probabilities for {len(committed)} tokens")
        return committed

    def _on_stale(self, verdict: Verdict) -> None:
        """Retries a refused block when the lengths agree (a transient refusal); otherwise stops.

        When the target's committed length differs from the draft's, the tokens in between are
        unknown to one side (the verdict carries none), so no block could be built that the target
        would accept without guessing. Stopping is lossless: only committed tokens were streamed.
        """
        self._stale_in_a_row += 1
        session = self._spec.session_id
        if verdict.committed_len != self._committed_len:
            raise DivergedError(
                f"session {session!r}: the target has {verdict.committed_len} committed tokens but the "
                f"draft has {self._committed_len}; continue the session with the target's Generate"
            )
        if self._stale_in_a_row > MAX_STALE_RETRIES:
            raise DivergedError(
                f"session {session!r}: the target refused {self._stale_in_a_row} blocks in a row as stale "
                f"at committed length {self._committed_len}"
            )
