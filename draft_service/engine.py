"""Per-session bookkeeping around the speculation loop, independent of gRPC.

The engine owns what outlives one round: the registry of running sessions, the metrics, and the
cleanup rules. Its one subtle rule is when to ``Release`` the target session: only when the caller
abandoned the stream (client disconnect, cancellation). A loop that finished needs no release (the
target frees finished sessions), and a loop that failed must leave the target session alone so the
caller can fall back to the target's Generate and continue it without losing a token.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from draft_service.errors import SessionBusyError, TokenizerMismatchError
from draft_service.loop import BlockVerifier, SpeculationLoop
from draft_service.proposers.base import Proposer
from draft_service.types import RoundResult, SessionSpec, TargetInfo
from tandem.metrics import Metrics
from tandem.model_worker import ModelWorker

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
    """The target operations the engine needs (``target_client.TargetClient`` in production)."""

    def open_verify_stream(self, session_id: str) -> VerifyStream: ...

    async def release(self, session_id: str) -> bool: ...


class _Outcome(enum.Enum):
    ABANDONED = "abandoned"  # the consumer stopped listening: release the target session
    COMPLETED = "completed"
    FAILED = "failed"


class DraftEngine:
    def __init__(
        self,
        proposer: Proposer,
        target: TargetPort,
        target_info: TargetInfo,
        worker: ModelWorker,
        metrics: Metrics,
        *,
        default_k: int,
        release_timeout_s: float = 10.0,
    ) -> None:
        self.proposer = proposer
        self.target_info = target_info
        self.default_k = default_k
        self._target = target
        self._worker = worker
        self._metrics = metrics
        self._release_timeout_s = release_timeout_s
        self._sessions: dict[str, SessionSpec] = {}
        self._cleanups: set[asyncio.Task[None]] = set()

    @property
    def active_sessions(self) -> list[str]:
        return list(self._sessions)

    async def speculate(self, spec: SessionSpec) -> AsyncIterator[RoundResult]:
        """Runs a validated session to its end, yielding each round's committed tokens.

        Close the iterator (``contextlib.aclosing``) when abandoning it: that is what frees the
        session and releases it in the target.
        """
        self._check_fingerprint(spec)
        if spec.session_id in self._sessions:
            raise SessionBusyError(f"session {spec.session_id!r} already has a Speculate call running")
        self._sessions[spec.session_id] = spec
        gauge = self._metrics.sessions_active.labels(mode=MODE)
        gauge.inc()
        outcome = _Outcome.ABANDONED
        proposer_session = None
        stream: VerifyStream | None = None
        try:
            proposer_session = await self._worker.run(self.proposer.new_session, spec.token_ids, spec.sampling)
            stream = self._target.open_verify_stream(spec.session_id)
            loop = SpeculationLoop(
                spec,
                proposer_session,
                stream,
                self._worker.run,
                max_context_len=self.target_info.max_context_len,
                tokenizer_fingerprint=self.proposer.tokenizer_fingerprint,
                want_hidden_states=self.proposer.wants_hidden_states,
            )
            async for result in loop.rounds():
                if result.verified:
                    self._metrics.record_round(result.num_draft_tokens, result.num_accepted)
                yield result
            outcome = _Outcome.COMPLETED
        except Exception:
            outcome = _Outcome.FAILED
            raise
        finally:
            # CancelledError and GeneratorExit (BaseException) leave the outcome ABANDONED.
            del self._sessions[spec.session_id]
            gauge.dec()
            if proposer_session is not None:
                # Queued behind a proposal that may still run for this session on the model thread.
                self._worker.submit(proposer_session.close)
            if stream is not None:
                if outcome is _Outcome.COMPLETED:
                    await stream.close()
                else:
                    stream.cancel()
            if outcome is _Outcome.ABANDONED:
                self._release_later(spec.session_id)

    async def aclose(self) -> None:
        """Waits for pending target releases (service shutdown)."""
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

    def _check_fingerprint(self, spec: SessionSpec) -> None:
        expected = self.target_info.tokenizer_fingerprint
        if spec.tokenizer_fingerprint and spec.tokenizer_fingerprint != expected:
            raise TokenizerMismatchError(
                f"session {spec.session_id!r} was tokenized with fingerprint {spec.tokenizer_fingerprint}, "
                f"but target {self.target_info.model_name!r} has {expected}"
            )

    def _release_later(self, session_id: str) -> None:
        # A task of its own: the handler that noticed the abandonment is being cancelled itself.
        task = asyncio.get_running_loop().create_task(self._release(session_id))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _release(self, session_id: str) -> None:
        try:
            await asyncio.wait_for(self._target.release(session_id), self._release_timeout_s)
            log.info("released abandoned session %r in the target", session_id)
        except Exception as exc:  # noqa: BLE001 (the target's TTL frees it eventually)
            log.warning("could not release session %r in the target: %r", session_id, exc)
