"""The speculation loop with blocks in flight: the next block goes out before the verdict of the
one before it, so a round does not wait for the draft-target round trip (issue 28).

Block n+1 assumes block n accepted whole (a token tree: along its most probable path) with a
guessed bonus token: the proposer, run on the sequence as block n would leave it, proposes one
token more than the block carries, and the first is the guess (of a tree: its most probable root,
and the block carries the subtree under it). The block names that assumption (``assumed_token_ids`` after the confirmed
``base_len``); the target verifies it only if the assumption is exactly what it committed and
answers STALE otherwise, at no pass. So the loop streams only verdicts' committed tokens, greedy
and sampled alike: lossless as the synchronous loop, whatever is assumed.

At most ``depth`` blocks are in flight, counting only those whose assumption still holds, and one
goes out ahead of a verdict only where the measured hop to the target says it pays
(``draft_service.hop``: over loopback it does not). A
verdict that breaks the assumption of the blocks behind it dooms them: they come back STALE and
are dropped, and the next block is proposed from the verdict at once. A feature-conditioned
proposer (eagle) has no target hidden state for assumed tokens: it rolls its own features over
them, as it does inside a block (mostly from what it predicted while drafting them, at no extra
step), and the verdict's states replace them.

When the call's budget is spent, no block is sent, but the blocks in flight are awaited and what
they commit is streamed: the target commits them whoever listens, and the caller must see every
committed token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import torch

from draft_service.errors import ProtocolError
from draft_service.hop import HopStats
from draft_service.loop import PendingCommit, PipelinedVerifier, SpeculationLoop
from draft_service.types import FinishReason, Proposal, ProposedBlock, RoundResult, VerdictStatus


@dataclass
class _Flight:
    """A block sent and not answered yet."""

    block: ProposedBlock
    expects: tuple[int, ...]  # the committed sequence the block needs (base + assumed), whole
    sources: tuple[str, ...]  # of its drafts, for the acceptance tally
    started: float
    proposed: float
    sent: float
    alone: bool = False  # nothing was in flight when it went: its round trip is the hop's alone

    @property
    def proposal(self) -> Proposal:
        return self.block.proposal

    @property
    def assumes(self) -> bool:
        return bool(self.block.assumed_token_ids)


class PipelinedLoop(SpeculationLoop):
    """:class:`SpeculationLoop` with up to ``depth`` blocks in flight (a ``PipelinedVerifier``)."""

    def __init__(self, *args, depth: int = 2, hop: HopStats | None = None, **kwargs) -> None:
        """``hop``: the measured hop to this target, which decides whether a block goes out
        ahead of a verdict (``draft_service.hop``); None: always, up to ``depth``."""
        super().__init__(*args, **kwargs)
        self._depth = depth
        self._hop = hop
        self._pipe: PipelinedVerifier = self._verifier  # type: ignore[assignment]
        self._sequence = list(self._spec.token_ids)  # confirmed by verdicts
        self.stale_blocks = 0  # blocks sent on an assumption that did not hold
        self.held_blocks = 0  # blocks sent on an assumption that held (verified)
        self._reported = (0, 0)  # (held, stale) at the last judged_since_last
        # Blocks with lower ids are doomed whatever they assumed: a block before them was refused.
        self._doomed_below = 0
        self._proposer_ahead = False  # the proposer session holds assumed tokens

    def judged_since_last(self) -> tuple[int, int]:
        """(held, stale): blocks sent on an assumption and judged since the last call (a metric's)."""
        counts = (self.held_blocks - self._reported[0], self.stale_blocks - self._reported[1])
        self._reported = (self.held_blocks, self.stale_blocks)
        return counts

    @property
    def pending_commit(self) -> PendingCommit | None:
        """As the synchronous loop's, and it also drops the assumptions the proposer still holds
        (a parked session resumes from the confirmed sequence)."""
        if self._pending_commit is None and self._proposer_ahead:
            return (len(self._sequence), (), None)
        return self._pending_commit

    async def rounds(self) -> AsyncIterator[RoundResult]:
        flights: deque[_Flight] = deque()
        while True:
            while len(self._viable(flights)) < self._depth and not self._call_budget_spent():
                if self._viable(flights) and self._hop is not None and not self._hop.send_ahead():
                    break
                flight = await self._launch(flights)
                if flight is None:
                    break
                flights.append(flight)
            if not flights:
                return
            flight = flights.popleft()
            verdict = await self._pipe.receive(flight.block.block_id)
            answered = self._clock()
            if self._hop is not None:
                if flight.alone and verdict.status is not VerdictStatus.STALE:
                    self._hop.observe_transport(answered - flight.sent - verdict.verify_seconds)
                if flight.assumes:
                    self._hop.observe_ahead(verdict.status is not VerdictStatus.STALE)
            if verdict.block_id != flight.block.block_id:
                raise ProtocolError(f"verdict for block {verdict.block_id} arrived, block {flight.block.block_id} expected")
            if verdict.status is VerdictStatus.STALE:
                if flight.assumes:
                    self.stale_blocks += 1  # an assumption that did not hold: expected, free
                else:
                    self._on_stale(verdict)
                    self._doomed_below = self._next_block_id  # they assumed this block's outcome
                continue
            self._stale_in_a_row = 0
            self.held_blocks += flight.assumes
            if verdict.status is VerdictStatus.FINISHED:
                yield RoundResult(token_ids=(), committed_len=verdict.committed_len or len(self._sequence),
                                  finish_reason=verdict.finish_reason, num_draft_tokens=0, num_accepted=0,
                                  round_seconds=answered - flight.started, verify_seconds=verdict.verify_seconds,
                                  verified=False)
                return
            base = len(flight.expects)
            committed = self._check_ok(base, flight.proposal, verdict)
            self._pending_commit = _after(self._pending_commit, (base, committed, verdict.hidden_states))
            self._sequence.extend(committed)
            self._committed_len += len(committed)
            self._streamed += len(committed)
            if flight.sources:
                self.acceptance.observe(flight.sources[: len(flight.proposal.token_ids)], verdict.num_accepted)
            yield RoundResult(
                token_ids=committed, committed_len=verdict.committed_len, finish_reason=verdict.finish_reason,
                num_draft_tokens=len(flight.proposal.token_ids), num_accepted=verdict.num_accepted,
                round_seconds=answered - flight.started, verify_seconds=verdict.verify_seconds,
                num_draft_positions=flight.proposal.positions, propose_seconds=flight.proposed - flight.started,
                exchange_seconds=answered - flight.sent,
            )
            if verdict.finish_reason is not FinishReason.NONE:
                return

    def _viable(self, flights: Sequence[_Flight]) -> list[_Flight]:
        """The blocks in flight that may still be verified: not sent before a refused block, and
        assuming only what agrees with the confirmed sequence. Doomed ones may sit before them
        (sent earlier, answered STALE when their turn comes)."""
        return [flight for flight in flights if flight.block.block_id >= self._doomed_below
                and flight.expects[: len(self._sequence)] == tuple(self._sequence[: len(flight.expects)])]

    async def _launch(self, flights: Sequence[_Flight]) -> _Flight | None:
        """Proposes and sends the next block: on the confirmed sequence when nothing viable is in
        flight, else on what the last viable block would leave (None when the proposer has no
        token to guess its bonus token with)."""
        started = self._clock()
        viable = self._viable(flights)
        if not viable:
            expects: tuple[int, ...] = tuple(self._sequence)
            k = self._block_size(len(expects))
            commit = self._pending_commit
            if commit is None and self._proposer_ahead:  # drop the assumptions that did not hold
                commit = (len(self._sequence), (), None)
            proposal = await self._run_model(self._commit_and_propose, commit, k)
            self._proposer_ahead = False
            assumed: tuple[int, ...] = ()
        else:
            last = viable[-1]
            ahead = (*last.expects, *last.proposal.likely_path())  # the last block accepted whole
            k = self._block_size(len(ahead) + 1)
            if k <= 0 and self._block_size(len(ahead)) <= 0:
                return None
            guessed = await self._run_model(self._assume_and_propose, self._pending_commit, ahead, k + 1)
            self._pending_commit, self._proposer_ahead = None, True
            if not guessed.token_ids:
                return None
            expects = (*ahead, guessed.token_ids[0])  # ... with the proposer's guess of its bonus token
            proposal = guessed.below_first()  # of a tree: the subtree under its most probable root
            assumed = expects[len(self._sequence):]
        self._pending_commit = None  # applied on the model thread with this proposal
        proposed = self._clock()
        sources: tuple[str, ...] = ()
        if self._lengths is not None and not proposal.parents and proposal.sources:
            sources = tuple(self._source_prefix + source for source in proposal.sources)
            proposal = proposal.cut(self._lengths.length(sources, self.acceptance))
        block = ProposedBlock(
            session_id=self._spec.session_id, block_id=self._next_block_id, base_len=len(self._sequence),
            proposal=proposal, tokenizer_fingerprint=self._fingerprint,
            return_hidden_states=self._want_hidden_states, assumed_token_ids=tuple(assumed),
        )
        self._next_block_id += 1
        if self._hop is not None:
            self._hop.observe_propose(proposed - started, ahead=bool(assumed))
        await self._pipe.send(block)
        return _Flight(block, expects, sources, started, proposed, self._clock(), alone=not flights)

    def _assume_and_propose(self, commit: PendingCommit | None, ahead: Sequence[int], k: int) -> Proposal:
        """On the model thread: apply the last verdict, take ``ahead`` as committed (no hidden
        states: nobody computed them yet), draft up to k tokens."""
        if commit is not None:
            self._proposer.commit(*commit)
        confirmed = len(self._sequence)
        self._proposer.commit(confirmed, list(ahead[confirmed:]), None)
        return self._proposer.propose(k)


def _after(pending: PendingCommit | None, verdict: PendingCommit) -> PendingCommit:
    """One commit for the proposer that applies ``pending`` and then ``verdict``: verdicts that
    arrive before the next proposal (blocks in flight answer back to back) must all reach the
    proposer session, which holds the sequence as of the last one it applied (or assumed past it)."""
    if pending is None:
        return verdict
    base, tokens, states = pending
    if verdict[0] != base + len(tokens):
        raise ProtocolError(f"a verdict onto {verdict[0]} tokens follows one that left {base + len(tokens)}")
    if not tokens:
        return (base, verdict[1], verdict[2])
    if states is None or verdict[2] is None:
        return (base, (*tokens, *verdict[1]), None)
    return (base, (*tokens, *verdict[1]), torch.cat([states, verdict[2]]))  # [n1 + n2, hidden]
