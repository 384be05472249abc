"""The speculation loop with blocks in flight: the next block goes out before the verdict of the
one before it, so a round need not wait for the draft-target round trip (issue 28;
docs/pipelining.md).

A block sent ahead assumes an outcome of the block before it (``Proposal.outcomes``): accepted
whole (a token tree: along its most probable path) and then a guessed bonus token, or rejected at
one of its drafts and then the proposer's best other guess there. Up to ``hedges`` blocks go out on
one block, each on another outcome; the outcomes exclude each other, so at most one holds. A block
names its assumption (``assumed_token_ids`` after the confirmed ``base_len``); the target verifies
it only if that is exactly what it committed and answers STALE otherwise, at no pass. So the loop
streams only verdicts' committed tokens, greedy and sampled alike: lossless as the synchronous
loop, whatever is assumed.

At most ``depth`` blocks stand in a chain of assumptions (after hedges, the next link waits for
the verdict that says which one holds), and a block goes out ahead only where the measured hop to
the target says it pays (``draft_service.hop``: over loopback it does not). A verdict that breaks
the assumptions of the blocks behind it dooms them: they come back STALE and are dropped, and the
next block is proposed from the verdict at once. A feature-conditioned proposer (eagle) has no
target hidden state for assumed tokens: it rolls its own features over them, as it does inside a
block (mostly from what it predicted while drafting them, at no extra step), and the verdict's
states replace them.

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
from draft_service.loop import PendingCommit, PipelinedVerifier, SpeculationLoop, prediction_counts
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
    parent: int = -1  # the block whose outcome it assumes (-1: none, it extends the confirmed sequence)
    rank: int = 0  # among the blocks sent on the same parent, most likely outcome first

    @property
    def proposal(self) -> Proposal:
        return self.block.proposal

    @property
    def assumes(self) -> bool:
        return bool(self.block.assumed_token_ids)


class PipelinedLoop(SpeculationLoop):
    """:class:`SpeculationLoop` with up to ``depth`` blocks in flight (a ``PipelinedVerifier``)."""

    def __init__(self, *args, depth: int = 2, hedges: int = 1, **kwargs) -> None:
        """``hedges``: blocks sent ahead on one block, each on another of its likely outcomes
        (``Proposal.outcomes``). The loop's ``hop`` (the measured hop to the target) decides
        whether a block goes out ahead of a verdict (``draft_service.hop``); None: always, up to
        ``depth``."""
        super().__init__(*args, **kwargs)
        self._depth = depth
        self._hedges = hedges
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
            while not self._call_budget_spent() and await self._launch_next(flights):
                pass
            if not flights:
                return
            flight = flights.popleft()
            verdict = await self._pipe.receive(flight.block.block_id)
            answered = self._clock()
            if self._hop is not None:
                if flight.alone and verdict.status is not VerdictStatus.STALE:
                    self._hop.observe_exchange(answered - flight.sent, verdict.verify_seconds)
                if flight.assumes:
                    self._hop.observe_ahead(verdict.status is not VerdictStatus.STALE, flight.rank)
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
            if self._shapes is not None and flight.proposal.shape and flight.alone:  # a round of its own
                self._shapes.observe(flight.proposal.shape, len(committed), answered - flight.started)
            self._pending_commit = _after(self._pending_commit, (base, committed, verdict.hidden_states))
            self._sequence.extend(committed)
            self._committed_len += len(committed)
            self._streamed += len(committed)
            self._learn(flight.proposal, flight.sources, verdict, seconds=answered - flight.sent if flight.alone else None,
                        propose_seconds=flight.proposed - flight.started)
            predicted, predicted_accepted = prediction_counts(flight.proposal, committed, verdict.num_accepted)
            yield RoundResult(
                token_ids=committed, committed_len=verdict.committed_len, finish_reason=verdict.finish_reason,
                num_draft_tokens=len(flight.proposal.token_ids), num_accepted=verdict.num_accepted,
                round_seconds=answered - flight.started, verify_seconds=verdict.verify_seconds,
                num_draft_positions=flight.proposal.positions, propose_seconds=flight.proposed - flight.started,
                exchange_seconds=answered - flight.sent, step_seconds=verdict.step_seconds,
                logprobs=verdict.logprobs,
                num_prediction_drafts=predicted, num_prediction_accepted=predicted_accepted,
            )
            if verdict.finish_reason is not FinishReason.NONE:
                return

    def _viable(self, flights: Sequence[_Flight]) -> list[_Flight]:
        """The blocks in flight that may still be verified: not sent before a refused block, and
        assuming only what agrees with the confirmed sequence. Doomed ones may sit before them
        (sent earlier, answered STALE when their turn comes)."""
        return [flight for flight in flights if flight.block.block_id >= self._doomed_below
                and flight.expects[: len(self._sequence)] == tuple(self._sequence[: len(flight.expects)])]

    async def _launch_next(self, flights: deque[_Flight]) -> bool:
        """Sends what may go out now; False when nothing may until a verdict comes: a block on the
        confirmed sequence when nothing viable is in flight, else blocks ahead on the last viable
        one (its tip), up to ``hedges`` of them on its likely outcomes, unless it has some already,
        is one of several hedges (which one holds is not known yet), or ``depth`` blocks stand in a
        chain of assumptions before it."""
        viable = self._viable(flights)
        if not viable:
            flights.append(await self._launch_plain(flights))
            return True
        tip = viable[-1]
        by_id = {flight.block.block_id: flight for flight in viable}
        if any(flight.parent == tip.block.block_id for flight in viable):
            return False
        if tip.parent >= 0 and sum(flight.parent == tip.parent for flight in viable) > 1:
            return False
        chain, parent = 1, tip.parent
        while parent in by_id:
            chain, parent = chain + 1, by_id[parent].parent
        if chain >= self._depth:
            return False
        sent = False
        for rank, (accepted, excluded) in enumerate(tip.proposal.outcomes()[: self._hedges]):
            if self._hop is not None and not self._hop.send_ahead(rank):
                continue  # each outcome is priced alone
            flight = await self._launch_ahead(flights, tip, accepted, excluded, rank)
            if flight is not None:
                flights.append(flight)
                sent = True
        return sent

    async def _launch_plain(self, flights: Sequence[_Flight]) -> _Flight:
        """Proposes and sends a block on the confirmed sequence."""
        started = self._clock()
        expects = tuple(self._sequence)
        commit = self._pending_commit
        if commit is None and self._proposer_ahead:  # drop the assumptions that did not hold
            commit = (len(self._sequence), (), None)
        proposal = await self._run_model(self._commit_and_propose, commit, self._block_size(len(expects)))
        self._proposer_ahead = False
        return await self._send(flights, proposal, expects, started)

    async def _launch_ahead(self, flights: Sequence[_Flight], tip: _Flight, accepted: tuple[int, ...],
                            excluded: frozenset[int] | None, rank: int) -> _Flight | None:
        """Proposes and sends a block on one outcome of ``tip``: ``accepted`` drafts of it, then a
        guessed token of the target's (the proposer's most likely one, or its most likely one
        outside ``excluded``). None when the proposer has no such guess or no room is left."""
        started = self._clock()
        ahead = (*tip.expects, *accepted)
        if self._block_size(len(ahead)) <= 0:
            return None  # the session's budget ends with the target's token there
        guessed = await self._run_model(self._guess_and_propose, self._pending_commit, len(self._sequence), ahead,
                                        excluded, self._block_size(len(ahead) + 1))
        self._pending_commit, self._proposer_ahead = None, True
        if guessed is None:
            return None
        guess, proposal = guessed
        return await self._send(flights, proposal, (*ahead, guess), started, parent=tip.block.block_id, rank=rank)

    async def _send(self, flights: Sequence[_Flight], proposal: Proposal, expects: tuple[int, ...], started: float,
                    parent: int = -1, rank: int = 0) -> _Flight:
        self._pending_commit = None  # applied on the model thread with this proposal
        proposed = self._clock()
        proposal, sources = self._cut(proposal)
        assumed = expects[len(self._sequence):]
        block = ProposedBlock(
            session_id=self._spec.session_id, block_id=self._next_block_id, base_len=len(self._sequence),
            proposal=proposal, tokenizer_fingerprint=self._fingerprint,
            return_hidden_states=self._want_hidden_states, assumed_token_ids=tuple(assumed),
        )
        self._next_block_id += 1
        if self._hop is not None:
            self._hop.observe_propose(proposed - started, ahead=bool(assumed))
        await self._pipe.send(block)
        return _Flight(block, expects, sources, started, proposed, self._clock(), alone=not flights, parent=parent,
                       rank=rank)

    def _guess_and_propose(self, commit: PendingCommit | None, confirmed: int, ahead: Sequence[int],
                           excluded: frozenset[int] | None, k: int) -> tuple[int, Proposal] | None:
        """On the model thread: apply the last verdict, take ``ahead`` as committed (no hidden
        states: nobody computed them yet), guess the target's next token (outside ``excluded``;
        None: the proposer's first draft), take it as committed too, draft up to k tokens after it."""
        if commit is not None:
            self._proposer.commit(*commit)
        self._proposer.commit(confirmed, list(ahead[confirmed:]), None)
        if excluded is None:
            drafted = self._proposer.propose(k + 1)
            # Of a tree: its most probable root, and the subtree under it.
            return (drafted.token_ids[0], drafted.below_first()) if drafted.token_ids else None
        guess = next((t for t in self._proposer.next_tokens(len(excluded) + 1) if t not in excluded), None)
        if guess is None:
            return None
        self._proposer.commit(len(ahead), [guess], None)
        return guess, self._proposer.propose(k) if k > 0 else Proposal()


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
