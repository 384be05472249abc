"""Drives one request through the upstreams and turns committed tokens into text events.

A :class:`Generation` owns one target session from ``Prefill`` to ``Release``:

1. :meth:`Generation.start` prefills the session (prompt → first token). Errors here happen before
   any output, so the APIs can still answer with a plain error status.
2. :meth:`Generation.events` streams :class:`TextDelta` events and one final :class:`Finished`.
   Tokens come from the draft service's ``Speculate`` or the target's ``Generate``, as the
   :class:`gateway.policy.SpeculationPolicy` decides; if the draft becomes unreachable and the
   policy allows it, the session continues on ``Generate`` without losing a token.
3. :meth:`Generation.aclose` (also ``async with``) runs on every exit path: finish, stop string,
   error, client disconnect. It cancels the upstream stream first (a cancelled ``Speculate`` makes
   the draft release its state) and then releases the target session.

Tokens are processed one at a time even when a speculation round commits several, so stop
strings, ``max_tokens`` and the usage counts do not depend on how tokens were batched: speculative
and autoregressive decoding of the same tokens give the same response.

Every batch is checked against the upstream's ``committed_len``; a gap (tokens committed in the
target that the gateway never saw) fails the request loudly rather than returning a text with a
hole in it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.admission import Ticket
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import GatewayError, UpstreamFailure, UpstreamUnavailable
from gateway.events import Event, Finished, SpeculationStats, TextDelta, Usage
from gateway.policy import Decision, Mode, SpeculationPolicy
from gateway.request import GenerationRequest
from gateway.served_model import ServedModel
from gateway.stop import StopStringMatcher
from gateway.upstream import DraftUpstream, TargetUpstream, UpstreamStream
from tandem.metrics import Metrics
from tandem.v1 import common_pb2, draft_pb2, target_pb2

log = logging.getLogger(__name__)

_FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class _Batch:
    """Tokens one upstream message committed, with the round that produced them (if speculative)."""

    token_ids: Sequence[int]
    finish_reason: int
    committed_len: int
    # The mode whose upstream sent it; None for the first token, which Prefill returns.
    mode: Mode | None = None
    num_draft_tokens: int = 0
    num_accepted: int = 0


class BackgroundTasks:
    """Keeps strong references to fire-and-forget tasks (asyncio holds only weak ones) so that a
    session release started by a cancelled request still runs to completion."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclass
class GenerationDeps:
    """What a generation needs from the gateway; one instance is shared by all requests."""

    target: TargetUpstream
    draft: DraftUpstream
    model: ServedModel
    policy: SpeculationPolicy
    metrics: Metrics
    draft_ready: Callable[[], bool]
    default_num_speculative_tokens: int
    background: BackgroundTasks = field(default_factory=BackgroundTasks)


class Generation:
    def __init__(
        self,
        request: GenerationRequest,
        deps: GenerationDeps,
        ticket: Ticket | None = None,
        received_at: float | None = None,
    ) -> None:
        """``received_at``: ``time.monotonic()`` when the request arrived (TTFT and end-to-end
        latency count from there, tokenization included); default now."""
        self.request = request
        self.session_id = uuid.uuid4().hex
        self._deps = deps
        self._ticket = ticket
        self._started_at = time.monotonic() if received_at is None else received_at
        self._last_token_at = self._started_at
        self._completion: list[int] = []
        self._detokenizer = IncrementalDetokenizer(deps.model.tokenizer, context_ids=request.prompt_token_ids)
        self._stop = StopStringMatcher(request.stop)
        self._stats = SpeculationStats()
        self._mode: Mode | None = None
        self._prefill: target_pb2.PrefillResponse | None = None
        self._stream: UpstreamStream[Any] | None = None
        self._finish_reason: str | None = None
        self._failed = False
        self._closed = False
        self._interrupted: GatewayError | None = None
        # From the Prefill call on, the target may hold a session that must be released.
        self._may_hold_session = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Chooses the mode and prefills the target session (the first token)."""
        self._enter(self._deps.policy.initial(self.request.speculation, self._deps.draft_ready()))
        self._may_hold_session = True
        try:
            self._prefill = await self._deps.target.prefill(
                target_pb2.PrefillRequest(
                    session_id=self.session_id,
                    prompt_token_ids=self.request.prompt_token_ids,
                    params=self._session_params(),
                    tokenizer_fingerprint=self._deps.model.fingerprint,
                )
            )
        except UpstreamUnavailable:
            # The prefill never reached the target: there is no session to release.
            self._failed, self._may_hold_session = True, False
            raise
        except Exception:  # not CancelledError / GeneratorExit: those are the client leaving
            self._failed = True
            raise
        self._deps.metrics.time_to_first_token.observe(time.monotonic() - self._started_at)

    async def events(self) -> AsyncIterator[Event]:
        """Text deltas, then one :class:`Finished`. Raises :class:`GatewayError` on upstream failure."""
        if self._prefill is None:
            raise RuntimeError("Generation.start() must succeed before events()")
        try:
            first = _Batch([self._prefill.token_id], self._prefill.finish_reason, self._prefill.committed_len)
            delta = self._consume(first)
            if delta.text or delta.token_ids:
                yield delta
            if self._finish_reason is None:
                async for batch in self._batches():
                    delta = self._consume(batch)
                    if delta.text or delta.token_ids:
                        yield delta
                    if self._finish_reason is not None:
                        break
            if self._finish_reason is None:
                raise UpstreamFailure("the upstream stream ended before the session finished", code="upstream_error")
        except Exception:  # not CancelledError / GeneratorExit: those are the client leaving
            self._failed = True
            raise
        self._deps.metrics.e2e_request_latency.observe(time.monotonic() - self._started_at)
        yield Finished(self._finish_reason, self.usage)

    def interrupt(self, error: GatewayError) -> None:
        """Ends the generation from outside (gateway shutdown): the consumer of :meth:`events`
        gets ``error`` instead of more tokens. Cancelling the upstream call wakes it up."""
        self._interrupted = error
        if self._stream is not None:
            self._stream.cancel()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def usage(self) -> Usage:
        return Usage(len(self.request.prompt_token_ids), len(self._completion), self._stats)

    async def aclose(self) -> None:
        """Cancels the upstream stream, releases the target session, settles metrics. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._stream is not None:
            self._stream.cancel()
        release = self._deps.background.spawn(self._release()) if self._may_hold_session else None
        metrics = self._deps.metrics
        if self._mode is not None:
            metrics.sessions_active.labels(mode=self._mode.value).dec()
        status = "error" if self._failed else (self._finish_reason or "abort")
        metrics.requests.labels(status=status).inc()
        if self._ticket is not None:
            self._ticket.release()
        if release is not None:
            # Shielded: a cancelled caller (client disconnect) must not cancel the release itself.
            await asyncio.shield(release)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- modes -------------------------------------------------------------------------------

    def _enter(self, decision: Decision) -> None:
        gauge = self._deps.metrics.sessions_active
        if self._mode is not None:
            gauge.labels(mode=self._mode.value).dec()
        gauge.labels(mode=decision.mode.value).inc()
        self._mode = self._stats.final_mode = decision.mode
        if decision.fallback_reason:
            self._stats.fallbacks += 1
            self._deps.metrics.session_fallbacks.labels(reason=decision.fallback_reason).inc()
            log.info("session %s decodes autoregressively (%s)", self.session_id, decision.fallback_reason)

    async def _batches(self) -> AsyncIterator[_Batch]:
        """Committed-token batches from the current mode's upstream, switching on draft failure."""
        while True:
            if self._interrupted is not None:
                raise self._interrupted
            try:
                if self._mode is Mode.SPECULATIVE:
                    self._stream = self._deps.draft.speculate(self._speculate_request())
                    async for r in self._stream:
                        yield _Batch(
                            r.token_ids, r.finish_reason, r.committed_len, Mode.SPECULATIVE,
                            r.num_draft_tokens, r.num_accepted,
                        )
                else:
                    self._stream = self._deps.target.generate(
                        target_pb2.TargetServiceGenerateRequest(session_id=self.session_id)
                    )
                    async for r in self._stream:
                        yield _Batch(r.token_ids, r.finish_reason, r.committed_len, Mode.AUTOREGRESSIVE)
                return
            except UpstreamUnavailable:
                if self._mode is not Mode.SPECULATIVE:
                    raise
                decision = self._deps.policy.on_draft_unavailable(self.request.speculation)
                if decision is None:
                    raise
                self._enter(decision)
            except asyncio.CancelledError:
                # A locally cancelled gRPC call raises CancelledError in its reader; after
                # interrupt() that is not the caller being cancelled.
                if self._interrupted is None:
                    raise
                raise self._interrupted from None

    def _session_params(self) -> common_pb2.SessionParams:
        sampling = self.request.sampling
        return common_pb2.SessionParams(
            sampling=common_pb2.SamplingParams(
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed
            ),
            max_new_tokens=self.request.max_tokens,
            ignore_eos=self.request.ignore_eos,
            stop_token_ids=self.request.stop_token_ids,
        )

    def _speculate_request(self) -> draft_pb2.SpeculateRequest:
        return draft_pb2.SpeculateRequest(
            session_id=self.session_id,
            token_ids=[*self.request.prompt_token_ids, *self._completion],
            prompt_len=len(self.request.prompt_token_ids),
            params=self._session_params(),
            num_speculative_tokens=self.request.num_speculative_tokens or self._deps.default_num_speculative_tokens,
            tokenizer_fingerprint=self._deps.model.fingerprint,
        )

    # -- tokens -> text ----------------------------------------------------------------------

    def _consume(self, batch: _Batch) -> TextDelta:
        """Takes a batch token by token until the request finishes; returns the printable delta."""
        self._check_committed_len(batch)
        self._observe_round(batch)
        taken: list[int] = []
        pieces: list[str] = []
        finish: str | None = None
        for token in batch.token_ids:
            taken.append(token)
            self._completion.append(token)
            pieces.append(self._stop.push(self._detokenizer.push(token)))
            if self._stop.matched is not None:
                finish = "stop"
                break
            if len(self._completion) >= self.request.max_tokens:
                finish = "length"
                break
        else:
            if batch.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                finish = self._upstream_finish(batch.finish_reason)
        if finish is not None:
            if self._stop.matched is None:
                pieces.append(self._stop.push(self._detokenizer.flush()))
                pieces.append(self._stop.flush())
                if self._stop.matched is not None:
                    finish = "stop"
            self._finish_reason = finish
        if batch.mode is not None and taken:
            self._stats.modes_used.add(batch.mode)
            self._observe_token_gap(len(taken))
        self._last_token_at = time.monotonic()
        return TextDelta("".join(pieces), tuple(taken))

    @staticmethod
    def _upstream_finish(reason: int) -> str:
        if reason in _FINISH_REASONS:
            return _FINISH_REASONS[reason]
        raise UpstreamFailure(
            f"the upstream ended the session unexpectedly ({common_pb2.FinishReason.Name(reason)})",
            code="upstream_error",
        )

    def _check_committed_len(self, batch: _Batch) -> None:
        expected = len(self.request.prompt_token_ids) + len(self._completion) + len(batch.token_ids)
        if batch.committed_len and batch.committed_len != expected:
            raise UpstreamFailure(
                f"session {self.session_id} is out of step with the target: {batch.committed_len} tokens "
                f"committed, but the gateway has received {expected}; refusing to return a text with gaps",
                code="upstream_error",
            )

    def _observe_round(self, batch: _Batch) -> None:
        if batch.num_draft_tokens > 0:
            self._stats.rounds += 1
            self._stats.draft_tokens += batch.num_draft_tokens
            self._stats.accepted_tokens += batch.num_accepted
            self._deps.metrics.record_round(batch.num_draft_tokens, batch.num_accepted)

    def _observe_token_gap(self, num_tokens: int) -> None:
        """Inter-token latency, amortised over the tokens of a batch so that a speculative round of
        k tokens counts as k tokens, comparable with autoregressive decoding."""
        gap = (time.monotonic() - self._last_token_at) / num_tokens
        for _ in range(num_tokens):
            self._deps.metrics.inter_token_latency.observe(gap)

    async def _release(self) -> None:
        try:
            await self._deps.target.release(self.session_id)
        except GatewayError as exc:
            # The target's session TTL frees it eventually; the request's outcome does not change.
            log.warning("could not release session %s: %s", self.session_id, exc.message)
