"""Per-session bookkeeping around the speculation loop, independent of gRPC.

The engine owns what outlives one round: the registry of running sessions, the proposer sessions
parked between two calls of one session, the metrics, and the cleanup rules. Its one subtle rule is
when to ``Release`` the target session: only when the caller abandoned the stream (client
disconnect, cancellation). A loop that finished needs no release (the target frees finished
sessions), and a loop that failed must leave the target session alone so the caller can fall back
to the target's Generate and continue it without losing a token.

The draft may front a pool of targets: each call's Verify stream and Release go to the target the
call names (``SessionSpec.target_address``), and a parked proposer session resumes only on the
target it was parked from.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from draft_service.block_length import AcceptanceTally, BlockLengthPolicy
from draft_service.errors import SessionBusyError, TokenizerMismatchError
from draft_service.guide import GrammarGuide
from draft_service.prediction import PredictedSession
from draft_service.hop import HopStats
from draft_service.loop import BlockVerifier, PendingCommit, SpeculationLoop
from draft_service.pipeline import PipelinedLoop
from draft_service.proposers.base import Proposer, ProposerSession
from draft_service.types import FinishReason, RoundResult, SamplingParams, SessionSpec, TargetInfo
from tandem.models.worker import ModelWorker
from tandem.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

MODE = "speculative"  # the sessions_active{mode} label of sessions driven by this service


class VerifyStream(BlockVerifier, Protocol):
    """One session's Verify stream to the target."""

    async def close(self) -> None:
        """Ends the stream gracefully after the session's last verdict."""
        ...

    def cancel(self) -> None:
        """Aborts the stream (the session was abandoned or failed)."""
        ...


class TargetPort(Protocol):
    """The operations on one target the engine needs (``target_client.TargetClient`` in production)."""

    def open_verify_stream(self, session_id: str) -> VerifyStream: ...

    async def release(self, session_id: str) -> bool: ...


class TargetPool(Protocol):
    """The draft's targets (``targets.TargetRouter`` in production): a session's requests all go
    to the target its Speculate request names."""

    def address_of(self, address: str) -> str:
        """The target a request's ``target_address`` stands for ("" = the pool's default)."""
        ...

    async def client(self, address: str) -> TargetPort:
        """That target's port; raises UnknownTargetError (an InvalidRequestError) for a non-member."""
        ...


@dataclass
class _Parked:
    """A proposer session kept between two Speculate calls of one target session."""

    session: ProposerSession
    target_address: str  # the target the session was verified by (a resumed call must name the same)
    token_ids: tuple[int, ...]  # the committed sequence it stands for, pending commit included
    sampling: SamplingParams
    pending_commit: PendingCommit | None
    parked_at: float
    acceptance: AcceptanceTally | None = None  # the session's own record for the block-length policy


class _Outcome(enum.Enum):
    ABANDONED = "abandoned"  # the consumer stopped listening: release the target session
    COMPLETED = "completed"
    FAILED = "failed"


class DraftEngine:
    def __init__(
        self,
        proposer: Proposer,
        targets: TargetPool,
        target_info: TargetInfo,
        worker: ModelWorker,
        metrics: Metrics,
        *,
        default_k: int,
        release_timeout_s: float = 10.0,
        park_ttl_s: float = 60.0,
        max_parked: int = 256,
        block_lengths: BlockLengthPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        pipeline_depth: int = 1,
        pipeline_hedges: int = 1,
        pipeline_ahead: str = "measured",
        guide: GrammarGuide | None = None,
    ) -> None:
        """``park_ttl_s``, ``max_parked``: how long and how many proposer sessions are kept for a
        session's next Speculate call (see :meth:`speculate`). ``block_lengths``: cuts every
        session's proposals to the length that pays best (None: they go whole). ``target_info``:
        of the target checked at start-up, standing for every target of the pool.
        ``pipeline_depth``: blocks of a session in flight at once (draft_service.pipeline; 1: the
        synchronous loop), sent ahead where the measured hop to their target says it pays
        (draft_service.hop, one per target address); ``pipeline_hedges``: blocks sent ahead on one
        block, each on another of its likely outcomes; ``pipeline_ahead``: "measured" (where the
        hop makes it pay) or "always". ``guide``: constrained sessions draft along their grammar
        (draft_service.guide; None: unguided)."""
        self.proposer = proposer
        self.target_info = target_info
        self.default_k = default_k
        self._targets = targets
        self._worker = worker
        self._metrics = metrics
        self._release_timeout_s = release_timeout_s
        self._sessions: dict[str, SessionSpec] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        self._parked: OrderedDict[str, _Parked] = OrderedDict()  # oldest first
        self._park_ttl_s = park_ttl_s
        self._max_parked = max_parked
        self._clock = clock
        self.block_lengths = block_lengths
        self.pipeline_depth = pipeline_depth
        self.pipeline_hedges = pipeline_hedges
        self.pipeline_ahead = pipeline_ahead
        self._hops: dict[str, HopStats] = {}
        self._guide = guide

    @property
    def active_sessions(self) -> list[str]:
        return list(self._sessions)

    def target_address_of(self, spec: SessionSpec) -> str:
        """The address of the target that holds ``spec``'s session (the pool's default for "")."""
        return self._targets.address_of(spec.target_address)

    async def speculate(self, spec: SessionSpec) -> AsyncIterator[RoundResult]:
        """Runs a validated session to its end, yielding each round's committed tokens.

        Close the iterator (``contextlib.aclosing``) when abandoning it: that is what frees the
        session and releases it in the target.

        A call that ends on its ``max_new_tokens`` with the session unfinished parks its proposer
        session, and the session's next call resumes it when it continues exactly where this one
        stopped. The gateway runs a session as a chain of such calls (legs, so it can switch to
        autoregressive decoding between them), and a fresh proposer session would cost a round:
        the eagle head has no feature until a verdict brings one, so its first block is empty.
        """
        self._check_fingerprint(spec)
        # Before any state: a target outside the pool is refused at no cost (UnknownTargetError).
        target = await self._targets.client(spec.target_address)
        target_address = self.target_address_of(spec)
        if spec.session_id in self._sessions:
            raise SessionBusyError(f"session {spec.session_id!r} already has a Speculate call running")
        self._sessions[spec.session_id] = spec
        gauge = self._metrics.sessions_active.labels(mode=MODE)
        gauge.inc()
        outcome = _Outcome.ABANDONED
        proposer_session = None
        stream: VerifyStream | None = None
        loop: SpeculationLoop | None = None
        committed = list(spec.token_ids)
        finish_reason = FinishReason.NONE
        try:
            proposer_session, pending_commit, acceptance = self._resume(spec, target_address)
            if proposer_session is None:
                proposer_session = await self._worker.run(self._new_session, spec)
            stream = target.open_verify_stream(spec.session_id)
            pipelined = {}
            if self.pipeline_depth > 1:
                pipelined = {"depth": self.pipeline_depth, "hedges": self.pipeline_hedges}
            loop = (PipelinedLoop if pipelined else SpeculationLoop)(
                spec,
                proposer_session,
                stream,
                self._worker.run,
                max_context_len=self.target_info.max_context_len,
                tokenizer_fingerprint=self.proposer.tokenizer_fingerprint,
                want_hidden_states=self.proposer.wants_hidden_states,
                pending_commit=pending_commit,
                lengths=self.block_lengths,
                acceptance=acceptance,
                hop=self._hops.setdefault(target_address, HopStats(always=self.pipeline_ahead == "always")),
                shapes=self.proposer.shapes_for(spec.sampling),
                **pipelined,
            )
            async for result in loop.rounds():
                self._count_pipelined(loop)
                if result.verified:
                    self._metrics.record_round(result.num_draft_tokens, result.num_accepted)
                    self._metrics.record_phases(
                        result.propose_seconds,
                        result.verify_seconds,
                        result.exchange_seconds - result.verify_seconds,
                        result.round_seconds - result.propose_seconds - result.exchange_seconds,
                    )
                committed.extend(result.token_ids)
                finish_reason = result.finish_reason
                yield result
            outcome = _Outcome.COMPLETED
        except Exception:
            outcome = _Outcome.FAILED
            raise
        finally:
            # CancelledError and GeneratorExit (BaseException) leave the outcome ABANDONED.
            del self._sessions[spec.session_id]
            gauge.dec()
            if loop is not None:
                self._count_pipelined(loop)
            if proposer_session is not None:
                if outcome is _Outcome.COMPLETED and finish_reason is FinishReason.NONE and loop is not None:
                    self._park(
                        spec, target_address, proposer_session, tuple(committed), loop.pending_commit, loop.acceptance
                    )
                else:
                    # Queued behind a proposal that may still run for this session on the model thread.
                    self._worker.submit(proposer_session.close)
            if stream is not None:
                if outcome is _Outcome.COMPLETED:
                    await stream.close()
                else:
                    stream.cancel()
            # A consumer that stops listening after the verdict that finished the session abandoned
            # nothing: the target has freed it already.
            if outcome is _Outcome.ABANDONED and finish_reason is FinishReason.NONE:
                self._release_later(target, spec.session_id)

    def _new_session(self, spec: SessionSpec) -> ProposerSession:
        """A proposer session for ``spec`` (on the model thread), guided by its grammar where it has one."""
        session = self.proposer.new_session(spec.token_ids, spec.sampling, spec.shaping)
        if spec.prediction_token_ids:  # the output begins where the client's text does (a moved session: earlier)
            start = spec.prompt_len - spec.continued_tokens
            session = PredictedSession(session, spec.prediction_token_ids, start, spec.token_ids)
        return session if self._guide is None else self._guide.wrap(session, spec)

    def _count_pipelined(self, loop: SpeculationLoop) -> None:
        """Adds a pipelined loop's blocks judged since the last count to the metric."""
        if isinstance(loop, PipelinedLoop):
            for outcome, count in zip(("verified", "stale"), loop.judged_since_last(), strict=True):
                if count:
                    self._metrics.pipelined_blocks.labels(outcome=outcome).inc(count)

    def _resume(
        self, spec: SessionSpec, target_address: str
    ) -> tuple[ProposerSession | None, PendingCommit | None, AcceptanceTally | None]:
        """The session's parked proposer session, its pending verdict and its acceptance record,
        when it stands for exactly the committed sequence (and sampling) of this call, on the same
        target; Nones otherwise."""
        self._expire_parked()
        parked = self._parked.pop(spec.session_id, None)
        if parked is None:
            return None, None, None
        if parked.target_address != target_address:
            # The session moved to another target (its first died): nothing parked is known to hold there.
            log.debug("session %r moved from target %s to %s", spec.session_id, parked.target_address, target_address)
            self._worker.submit(parked.session.close)
            return None, None, None
        if parked.token_ids != tuple(spec.token_ids) or parked.sampling != spec.sampling:
            # Tokens were committed meanwhile by someone else (the target's Generate): start afresh.
            self._worker.submit(parked.session.close)
            return None, None, parked.acceptance
        log.debug("session %r resumes its proposer session at %d tokens", spec.session_id, len(parked.token_ids))
        return parked.session, parked.pending_commit, parked.acceptance

    def _park(
        self,
        spec: SessionSpec,
        target_address: str,
        session: ProposerSession,
        token_ids: tuple[int, ...],
        pending_commit: PendingCommit | None,
        acceptance: AcceptanceTally | None = None,
    ) -> None:
        self._parked[spec.session_id] = _Parked(
            session, target_address, token_ids, spec.sampling, pending_commit, self._clock(), acceptance
        )
        self._parked.move_to_end(spec.session_id)
        while len(self._parked) > self._max_parked:
            _, oldest = self._parked.popitem(last=False)
            self._worker.submit(oldest.session.close)
        self._expire_parked()

    def _expire_parked(self) -> None:
        """Closes parked sessions older than the TTL (a session the gateway finished with elsewhere)."""
        now = self._clock()
        while self._parked:
            session_id, oldest = next(iter(self._parked.items()))
            if now - oldest.parked_at < self._park_ttl_s:
                return
            del self._parked[session_id]
            self._worker.submit(oldest.session.close)

    async def aclose(self) -> None:
        """Closes the parked proposer sessions and waits for pending target releases (service shutdown)."""
        while self._parked:
            self._worker.submit(self._parked.popitem()[1].session.close)
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

    def _check_fingerprint(self, spec: SessionSpec) -> None:
        expected = self.target_info.tokenizer_fingerprint
        if spec.tokenizer_fingerprint and spec.tokenizer_fingerprint != expected:
            raise TokenizerMismatchError(
                f"session {spec.session_id!r} was tokenized with fingerprint {spec.tokenizer_fingerprint}, "
                f"but target {self.target_info.model_name!r} has {expected}"
            )

    def _release_later(self, target: TargetPort, session_id: str) -> None:
        # A task of its own: the handler that noticed the abandonment is being cancelled itself.
        task = asyncio.get_running_loop().create_task(self._release(target, session_id))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _release(self, target: TargetPort, session_id: str) -> None:
        try:
            await asyncio.wait_for(target.release(session_id), self._release_timeout_s)
            log.info("released abandoned session %r in the target", session_id)
        except Exception as exc:  # noqa: BLE001 (the target's TTL frees it eventually)
            log.warning("could not release session %r in the target: %r", session_id, exc)
