"""Drives one request through the upstreams and turns committed tokens into text events.

A :class:`Generation` owns one request from ``Prefill`` to ``Release``:

1. :meth:`Generation.start` chooses the starting mode (:mod:`gateway.policy`) and prefills the
   target session (prompt → first token). Errors here happen before any output, so the APIs can
   still answer with a plain error status.
2. :meth:`Generation.events` streams :class:`TextDelta` events and one final :class:`Finished`.
   Tokens come in *legs* (:mod:`gateway.legs`): bounded ``Speculate`` or ``Generate`` streams that
   end by themselves, between which a :class:`gateway.adaptive.SessionController` may switch the
   session between speculation and autoregressive decoding. When the draft is unreachable, fails
   or stalls, the session goes on with ``Generate`` (``speculation: "auto"``) and the draft's
   circuit breaker (:mod:`gateway.breaker`) keeps new sessions off it until it is healthy. With
   another draft in the pool, the session moves to it instead. A target that dies or hangs moves
   the session to another target (a *failover*, :mod:`gateway.target_session`).
   With smoothing, a :class:`gateway.pacer.Pacer` spreads each batch over about one round.
3. :meth:`Generation.aclose` (also ``async with``) runs on every exit path: finish, stop string,
   error, client disconnect. It cancels the upstream stream first (a cancelled ``Speculate`` makes
   the draft release its state) and then releases the target session.

The parts, one idea each: :class:`gateway.target_session.TargetSession` (the target session: its
budget, prefill, resync and release), :class:`gateway.leg_reader.LegReader` (the upstream streams
of the legs), :class:`gateway.output.Output` (tokens to text, stop strings, ``max_tokens``, usage),
and :class:`gateway.counters.SessionCounters` (what all generations count together). This module
is the lifecycle that drives them: start, the legs and their mode switches, close. Upstream
messages are built and read in :mod:`gateway.wire` only.

Nothing is lost, duplicated or reordered: every batch is checked against the upstream's
``committed_len``. A gap (tokens committed in the target that the gateway never saw) fails the
request loudly, except right after a draft failure, where it is expected — the draft may have died
between the target's commit and forwarding the verdict. Then the gateway *resyncs* to a fresh
target session (:mod:`gateway.target_session`).

Invariant: :meth:`Generation.aclose`, whatever the path to it, counts the request once, ends its
session in the counters once (if it started one) and releases whichever target session the request
may hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from gateway.adaptive import SessionController
from gateway.admission import Ticket
from gateway.breaker import DraftFailure
from gateway.deps import GenerationDeps
from gateway.errors import GatewayError, TargetLost, UpstreamFailure
from gateway.events import Event, Finished, TextDelta, Usage
from gateway.leg_reader import LegReader
from gateway.legs import DraftLegFailed
from gateway.output import Output, joined
from gateway.pacer import Pacer, paced
from gateway.policy import DRAFT_UNAVAILABLE, Decision, Mode
from gateway.request import GenerationRequest, Smoothing, Speculation
from gateway.target_session import Resync, TargetSession
from gateway.types import Batch, TokenLogprob
from tandem import telemetry  # mode-switch span events (tandem/telemetry/)

log = logging.getLogger(__name__)


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
        self._deps = deps
        self._ticket = ticket
        self._started_at = time.monotonic() if received_at is None else received_at
        self._last_emit_at: float | None = None
        self._session = TargetSession(request, deps)
        self._output = Output(request, deps.model.tokenizer, deps.metrics)
        self._legs = LegReader(request, deps, self._session, self._output)
        self._mode: Mode | None = None
        self._controller: SessionController | None = None
        self._first: Batch | None = None  # the first token, from Prefill
        self._failed = False
        self._closed = False
        self._interrupted: GatewayError | None = None

    def prompt_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The log-probabilities of the prompt's tokens after the first, when the request asked for
        them (echo with logprobs; after :meth:`start`), else ()."""
        if not self.request.prompt_logprobs or self._first is None:
            return ()
        found = tuple(self._first.prompt_logprobs)
        if len(found) != len(self.request.prompt_token_ids) - 1:
            raise UpstreamFailure(
                f"the target sent {len(found)} log-probabilities for a prompt of {len(self.request.prompt_token_ids)} "
                "tokens (a target older than this gateway sends none)",
                code="upstream_error",
            )
        return found

    @property
    def session_id(self) -> str:
        """The current target session (a resync moves the request to a fresh one)."""
        return self._session.session_id

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Chooses the mode and prefills the target session (the first token)."""
        deps = self._deps
        counters = deps.counters
        prior, temperature = deps.policy.prior, self.request.sampling.temperature
        started_load = deps.sessions_per_target(counters.active_sessions + 1)

        def report(seconds_per_token: float, tokens: int) -> None:
            # The load the session saw: at its start or at its end, whichever was higher.
            load = max(started_load, deps.sessions_per_target())
            step_seconds = deps.step_timer.step_s(load)
            if step_seconds is not None:
                prior.observe(temperature, seconds_per_token, step_seconds, tokens, sessions=load)

        decision = deps.policy.initial(self.request, deps.can_speculate(), counters.active_sessions, started_load)
        self._controller = SessionController(
            deps.tuning.adaptive,
            deps.step_timer,
            decision,
            policy=deps.policy,
            can_speculate=lambda: deps.can_speculate() and not deps.policy.saturated(counters.active_sessions - 1),
            adaptive=self.request.speculation is Speculation.AUTO,
            report=report,
            prior_ratio=lambda: prior.ratio(temperature, deps.sessions_per_target()),
            load=deps.sessions_per_target,
        )
        self._enter(decision)
        try:
            self._first = await self._session.open()
        except Exception:  # not CancelledError / GeneratorExit: those are the client leaving
            self._failed = True
            raise
        self._deps.metrics.time_to_first_token.observe(time.monotonic() - self._started_at)

    async def events(self) -> AsyncIterator[Event]:
        """Text deltas, then one :class:`Finished`. Raises :class:`GatewayError` on upstream failure."""
        if self._first is None:
            raise RuntimeError("Generation.start() must succeed before events()")
        source: AsyncIterator[Any] = self._token_deltas()
        if (self.request.stream_smoothing or self._deps.tuning.smoothing) is Smoothing.AUTO:
            pacer: Pacer[TextDelta] = Pacer(self._deps.tuning.pacer)
            source = paced(source, pacer, is_batch=lambda e: isinstance(e, list), clock=time.monotonic)
        else:
            source = joined(source)
        try:
            async with aclosing(source) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        self._observe_emission(len(event.token_ids))
                    else:
                        self._deps.metrics.e2e_request_latency.observe(time.monotonic() - self._started_at)
                    yield event
        except Exception:  # not CancelledError / GeneratorExit: those are the client leaving
            self._failed = True
            raise

    def interrupt(self, error: GatewayError) -> None:
        """Ends the generation from outside (gateway shutdown): the consumer of :meth:`events`
        gets ``error`` instead of more tokens. Cancelling the upstream call wakes it up."""
        self._interrupted = error
        self._legs.cancel()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def usage(self) -> Usage:
        return self._output.usage

    async def aclose(self) -> None:
        """Cancels the upstream stream, releases the target session, settles metrics. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._legs.cancel()
        release = self._session.release_later(self._output.completion)
        if self._controller is not None and not self._failed:
            self._controller.finish()  # what speculation gave this session, for the temperature prior
        if self._mode is not None:
            self._deps.counters.ended(self._mode)
        status = "error" if self._failed else (self._output.finish_reason or "abort")
        self._deps.metrics.requests.labels(status=status).inc()
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
        """Switches the session's mode: gauge, usage, fallback counter and a log line."""
        counters = self._deps.counters
        switched = self._mode is not None
        if self._mode is None:
            counters.started(decision.mode)
        else:
            counters.switched(self._mode, decision.mode)
        self._mode = decision.mode
        self._output.entered(decision)
        tokens = len(self._output.completion)
        if decision.fallback_reason:
            counters.fell_back(decision.fallback_reason)
            log.info("session %s %s autoregressively (%s) after %d tokens%s", self.session_id,
                     "switches to decoding" if switched else "decodes", decision.fallback_reason,
                     tokens, f" ({self._controller.describe()})" if switched else "")
        elif switched:
            log.info("session %s probes speculation again after %d tokens", self.session_id, tokens)
        if decision.fallback_reason or switched:  # telemetry: the switch as an event on the request's span
            telemetry.record_mode_switch(decision.mode.value, decision.fallback_reason, tokens)

    async def _batches(self) -> AsyncIterator[Batch]:
        """Committed-token batches, leg after leg, switching modes between legs."""
        controller = self._controller
        assert controller is not None
        while True:
            if self._interrupted is not None:
                raise self._interrupted
            leg, switch = controller.next_leg()
            if switch is not None:
                self._enter(switch)
            produced = False
            try:
                async with aclosing(self._legs.read(leg, controller)) as batches:
                    async for batch in batches:
                        produced = produced or bool(batch.token_ids)
                        yield batch
            except TargetLost as lost:
                yield await self._session.failover(self._output.completion, lost)
                continue
            except DraftLegFailed as failed:
                try:  # a draft fails with its target too: then the session moves, the draft is not blamed
                    await self._session.check_alive(after=f"the draft failed: {failed.error.message}")
                except TargetLost as lost:
                    yield await self._session.failover(self._output.completion, lost)
                    continue
                if failed.member is not None and failed.member.breaker is not None and failed.recoverable:
                    failed.member.breaker.record_failure(failed.failure)
                if (failed.recoverable and failed.member is not None and self._deps.can_speculate()
                        and self._deps.drafts.can_place(frozenset({failed.member.address}))):
                    # Another draft of the pool takes the session on, from exactly what the client has.
                    self._legs.avoid_draft = frozenset({failed.member.address})
                    yield await self._session.resync(self._output.completion,
                                                     f"the draft at {failed.member.address} {failed.failure.value}",
                                                     mode=None)
                    continue
                if self.request.speculation is not Speculation.AUTO or not failed.recoverable:
                    log.warning("session %s: the draft %s (%s); not recovered (speculation %r)", self.session_id,
                                failed.failure.value, failed.error.message, self.request.speculation.value)
                    raise failed.error from failed
                log.warning("session %s: the draft %s (%s); continuing with the target's Generate",
                            self.session_id, failed.failure.value, failed.error.message)
                self._enter(controller.fall_back(DRAFT_UNAVAILABLE))
                if failed.failure is DraftFailure.STALLED:
                    # The abandoned draft may still commit, or release the session: leave it.
                    yield await self._session.resync(self._output.completion, "the draft stalled")
                else:
                    self._session.suspect = True
                continue
            except Resync as resync:
                yield await self._session.resync(self._output.completion, str(resync))
                continue
            except asyncio.CancelledError:
                # A locally cancelled gRPC call raises CancelledError in its reader; after
                # interrupt() that is not the caller being cancelled.
                if self._interrupted is None:
                    raise
                raise self._interrupted from None
            if leg.max_new_tokens == 0:
                return  # an unbounded leg ends with the session (the caller checks it finished)
            if not produced:
                raise UpstreamFailure(f"a {leg.mode.value} stream ended without committing a token",
                                      code="upstream_error")

    # -- tokens -> text ----------------------------------------------------------------------

    async def _token_deltas(self) -> AsyncIterator[list[TextDelta] | Finished]:
        """One list of per-token deltas per upstream batch, then :class:`Finished`."""
        assert self._first is not None
        output = self._output
        deltas = self._take(self._first)
        if deltas:
            yield deltas
        if output.finish_reason is None:
            async with aclosing(self._batches()) as batches:
                async for batch in batches:
                    deltas = self._take(batch)
                    if deltas:
                        yield deltas
                    if output.finish_reason is not None:
                        break
        if output.finish_reason is None:
            raise UpstreamFailure("the upstream stream ended before the session finished", code="upstream_error")
        yield Finished(output.finish_reason, self.usage)

    def _take(self, batch: Batch) -> list[TextDelta]:
        """Checks the batch against what the client has, then turns it into deltas."""
        self._session.check_in_step(batch.committed_len, self._output.expected_len(len(batch.token_ids)))
        return self._output.consume(batch)

    def _observe_emission(self, num_tokens: int) -> None:
        """Inter-token latency as the client sees it: the gap since the previous delta, amortised
        over the delta's tokens (so an unpaced round of k tokens counts as k equal gaps)."""
        now = time.monotonic()
        if num_tokens and self._last_emit_at is not None:  # the first token's wait is the TTFT
            gap = (now - self._last_emit_at) / num_tokens
            for _ in range(num_tokens):
                self._deps.metrics.inter_token_latency.observe(gap)
        self._last_emit_at = now
