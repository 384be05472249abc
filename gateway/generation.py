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
   circuit breaker (:mod:`gateway.breaker`) keeps new sessions off it until it is healthy.
   With smoothing, a :class:`gateway.pacer.Pacer` spreads each batch over about one round.
3. :meth:`Generation.aclose` (also ``async with``) runs on every exit path: finish, stop string,
   error, client disconnect. It cancels the upstream stream first (a cancelled ``Speculate`` makes
   the draft release its state) and then releases the target session.

Tokens are processed one at a time even when a speculation round commits several, so stop
strings, ``max_tokens`` and the usage counts do not depend on how tokens were batched or paced:
speculative and autoregressive decoding of the same tokens give the same response.

Nothing is lost, duplicated or reordered: every batch is checked against the upstream's
``committed_len``. A gap (tokens committed in the target that the gateway never saw) fails the
request loudly, except right after a draft failure, where it is expected — the draft may have died
between the target's commit and forwarding the verdict. Then the gateway *resyncs*: it prefills a
fresh target session with the prompt plus exactly the tokens the client has received, releases the
old one, and continues from there (the target's greedy output is the same; sampled output keeps the
target's distribution, as the discarded tokens were never shown).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial
from typing import Any

from gateway.adaptive import Leg, Round, SessionController
from gateway.admission import Ticket
from gateway.breaker import DraftFailure
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import GatewayError, UpstreamFailure, UpstreamUnavailable
from gateway.events import Event, Finished, SpeculationStats, TextDelta, Usage
from gateway.deps import GenerationDeps
from gateway.legs import Batch, DraftLegFailed, classify_draft_error, timed
from gateway.pacer import Pacer, paced
from gateway.policy import DRAFT_UNAVAILABLE, SPECULATION_OFF, Decision, Mode
from gateway.request import GenerationRequest, Smoothing, Speculation
from gateway.stop import StopStringMatcher
from gateway.upstream import UpstreamStream
from tandem import telemetry  # mode-switch span events (tandem/telemetry/)
from tandem.v1 import common_pb2, draft_pb2, target_pb2

log = logging.getLogger(__name__)

_FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}
# Fresh target sessions one request may need after draft failures before it gives up.
MAX_RESYNCS = 3


class _Resync(Exception):
    """The target session is no longer in step with what the client received."""


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
        self._last_emit_at: float | None = None
        self._completion: list[int] = []
        self._detokenizer = IncrementalDetokenizer(deps.model.tokenizer, context_ids=request.prompt_token_ids)
        self._stop = StopStringMatcher(request.stop)
        self._stats = SpeculationStats()
        self._mode: Mode | None = None
        self._controller: SessionController | None = None
        self._prefill: target_pb2.PrefillResponse | None = None
        self._stream: UpstreamStream[Any] | None = None
        self._finish_reason: str | None = None
        self._failed = False
        self._closed = False
        self._interrupted: GatewayError | None = None
        # From the Prefill call on, the target may hold a session that must be released.
        self._may_hold_session = False
        # The current target session's prompt length and token budget (they change on a resync).
        self._session_prompt_len = len(request.prompt_token_ids)
        self._session_budget = request.max_tokens
        # Set after a draft failure until a Generate message proves the target is in step.
        self._suspect = False
        self._resyncs = 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Chooses the mode and prefills the target session (the first token)."""
        deps = self._deps
        decision = deps.policy.initial(self.request, deps.can_speculate(), deps.active_sessions)
        self._controller = SessionController(
            deps.tuning.adaptive,
            deps.step_timer,
            decision,
            policy=deps.policy,
            can_speculate=lambda: deps.can_speculate() and not deps.policy.saturated(deps.active_sessions - 1),
            adaptive=self.request.speculation is Speculation.AUTO,
            report=partial(deps.policy.prior.observe, self.request.sampling.temperature),
            prior_ratio=partial(deps.policy.prior.ratio, self.request.sampling.temperature),
        )
        self._enter(decision)
        self._may_hold_session = True
        try:
            self._prefill = await self._prefill_session(self.request.prompt_token_ids)
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
        source: AsyncIterator[Any] = self._token_deltas()
        if (self.request.stream_smoothing or self._deps.tuning.smoothing) is Smoothing.AUTO:
            pacer: Pacer[TextDelta] = Pacer(self._deps.tuning.pacer)
            source = paced(source, pacer, is_batch=lambda e: isinstance(e, list), clock=time.monotonic)
        else:
            source = _joined(source)
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
        release = self._deps.background.spawn(self._release(self.session_id)) if self._may_hold_session else None
        metrics = self._deps.metrics
        if self._controller is not None and not self._failed:
            self._controller.finish()  # what speculation gave this session, for the temperature prior
        if self._mode is not None:
            metrics.sessions_active.labels(mode=self._mode.value).dec()
            self._deps.active_sessions -= 1
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
        """Switches the session's mode: gauge, usage, fallback counter and a log line."""
        gauge = self._deps.metrics.sessions_active
        if self._mode is None:
            self._deps.active_sessions += 1
        else:
            gauge.labels(mode=self._mode.value).dec()
        gauge.labels(mode=decision.mode.value).inc()
        switched = self._mode is not None
        self._mode = self._stats.final_mode = decision.mode
        if decision.fallback_reason:
            self._stats.fallback_reason = decision.fallback_reason
            self._stats.fallbacks += decision.fallback_reason != SPECULATION_OFF  # the client's choice is no fallback
            self._deps.metrics.session_fallbacks.labels(reason=decision.fallback_reason).inc()
            log.info("session %s %s autoregressively (%s) after %d tokens%s", self.session_id,
                     "switches to decoding" if switched else "decodes", decision.fallback_reason,
                     len(self._completion), f" ({self._controller.describe()})" if switched else "")
        elif switched:
            log.info("session %s probes speculation again after %d tokens", self.session_id, len(self._completion))
        if decision.fallback_reason or switched:  # telemetry: the switch as an event on the request's span
            telemetry.record_mode_switch(decision.mode.value, decision.fallback_reason, len(self._completion))

    async def _batches(self) -> AsyncIterator[Batch]:
        """Committed-token batches, leg after leg, switching modes between legs."""
        assert self._controller is not None
        while True:
            if self._interrupted is not None:
                raise self._interrupted
            leg, switch = self._controller.next_leg()
            if switch is not None:
                self._enter(switch)
            produced = False
            try:
                legs = self._speculative_leg(leg) if leg.mode is Mode.SPECULATIVE else self._autoregressive_leg(leg)
                async with aclosing(legs) as batches:
                    async for batch in batches:
                        produced = produced or bool(batch.token_ids)
                        yield batch
            except DraftLegFailed as failed:
                if self.request.speculation is not Speculation.AUTO or not failed.recoverable:
                    log.warning("session %s: the draft %s (%s); not recovered (speculation %r)", self.session_id,
                                failed.failure.value, failed.error.message, self.request.speculation.value)
                    raise failed.error from failed
                self._deps.breaker.record_failure(failed.failure)
                log.warning("session %s: the draft %s (%s); continuing with the target's Generate",
                            self.session_id, failed.failure.value, failed.error.message)
                self._enter(self._controller.fall_back(DRAFT_UNAVAILABLE))
                if failed.failure is DraftFailure.STALLED:
                    # The abandoned draft may still commit, or release the session: leave it.
                    yield await self._resync("the draft stalled")
                else:
                    self._suspect = True
                continue
            except _Resync as resync:
                yield await self._resync(str(resync))
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

    async def _speculative_leg(self, leg: Leg) -> AsyncIterator[Batch]:
        assert self._controller is not None
        stream = self._stream = self._deps.draft.speculate(self._speculate_request(leg.max_new_tokens))
        deps = self._deps
        deadline = deps.tuning.draft_stall_timeout_s
        cap = deadline * deps.tuning.draft_stall_cap_factor
        answered = False  # before a call's first round the draft takes the session on (its own prefill)

        def keep_waiting(waited_s: float) -> bool:
            # That prefill grows with the prompt and the machine's load: explained up to the cap.
            return waited_s < cap and (not answered or deps.draft_silence_explained(time.monotonic()))

        try:
            async for message, seconds in timed(stream, time.monotonic, deadline, keep_waiting):
                answered = True
                deps.last_draft_message = time.monotonic()
                self._deps.breaker.record_success()
                if message.token_ids:
                    self._controller.observe_round(
                        Round(len(message.token_ids), message.num_draft_tokens, message.num_accepted, seconds,
                              positions=message.num_draft_positions or None)
                    )
                    self._deps.step_timer.observe_verify(message.verify_seconds)
                yield Batch(message.token_ids, message.finish_reason, message.committed_len, Mode.SPECULATIVE,
                            message.num_draft_tokens, message.num_accepted)
        except TimeoutError:
            stream.cancel()
            error = UpstreamUnavailable(f"the draft service sent nothing for {deadline:g}s",
                                        code="upstream_unavailable")
            raise DraftLegFailed(DraftFailure.STALLED, error) from None
        except GatewayError as error:
            raise classify_draft_error(error) from error

    async def _autoregressive_leg(self, leg: Leg) -> AsyncIterator[Batch]:
        assert self._controller is not None
        request = target_pb2.TargetServiceGenerateRequest(session_id=self.session_id,
                                                          max_new_tokens=leg.max_new_tokens)
        stream = self._stream = self._deps.target.generate(request)
        try:
            async for message, seconds in timed(stream, time.monotonic):
                if self._suspect:
                    if message.committed_len != self._expected_len(len(message.token_ids)):
                        stream.cancel()
                        raise _Resync("the target committed tokens the failed draft never forwarded")
                    self._suspect = False
                if message.token_ids:
                    self._controller.observe_autoregressive(len(message.token_ids))
                    if seconds is not None:
                        self._deps.step_timer.observe_step(seconds / len(message.token_ids))
                yield Batch(message.token_ids, message.finish_reason, message.committed_len, Mode.AUTOREGRESSIVE)
        except GatewayError as error:
            if not self._suspect:
                raise
            # E.g. the failed draft's last verdict finished the session, or it released it.
            raise _Resync(f"the target session failed after the draft did: {error.message}") from error

    async def _resync(self, why: str) -> Batch:
        """Continues in a fresh target session prefilled with exactly the tokens the client has."""
        if self._resyncs >= MAX_RESYNCS:
            raise UpstreamFailure(f"session {self.session_id} lost step with the target {self._resyncs} times: {why}",
                                  code="upstream_error")
        self._resyncs += 1
        old, self.session_id = self.session_id, uuid.uuid4().hex
        log.warning("session %s: %s; continuing as session %s from the %d tokens streamed so far",
                    old, why, self.session_id, len(self._completion))
        self._deps.background.spawn(self._release(old))
        self._session_prompt_len = len(self.request.prompt_token_ids) + len(self._completion)
        self._session_budget = self.request.max_tokens - len(self._completion)
        self._suspect = False
        prefill = await self._prefill_session((*self.request.prompt_token_ids, *self._completion))
        return Batch([prefill.token_id], prefill.finish_reason, prefill.committed_len, Mode.AUTOREGRESSIVE)

    async def _prefill_session(self, token_ids: tuple[int, ...]) -> target_pb2.PrefillResponse:
        request = target_pb2.PrefillRequest(
            session_id=self.session_id,
            prompt_token_ids=token_ids,
            params=self._session_params(),
            tokenizer_fingerprint=self._deps.model.fingerprint,
        )
        self._deps.prefills_in_flight += 1  # a long prefill holds up every draft's next round
        try:
            return await self._deps.target.prefill(request)
        finally:
            self._deps.prefills_in_flight -= 1
            self._deps.last_prefill_done = time.monotonic()

    def _session_params(self) -> common_pb2.SessionParams:
        sampling = self.request.sampling
        return common_pb2.SessionParams(
            sampling=common_pb2.SamplingParams(
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed
            ),
            max_new_tokens=self._session_budget,
            ignore_eos=self.request.ignore_eos,
            stop_token_ids=self.request.stop_token_ids,
        )

    def _speculate_request(self, max_new_tokens: int) -> draft_pb2.SpeculateRequest:
        return draft_pb2.SpeculateRequest(
            session_id=self.session_id,
            token_ids=[*self.request.prompt_token_ids, *self._completion],
            prompt_len=self._session_prompt_len,
            params=self._session_params(),
            num_speculative_tokens=self.request.num_speculative_tokens or self._deps.default_num_speculative_tokens,
            tokenizer_fingerprint=self._deps.model.fingerprint,
            max_new_tokens=max_new_tokens,
        )

    # -- tokens -> text ----------------------------------------------------------------------

    async def _token_deltas(self) -> AsyncIterator[list[TextDelta] | Finished]:
        """One list of per-token deltas per upstream batch, then :class:`Finished`."""
        assert self._prefill is not None
        first = Batch([self._prefill.token_id], self._prefill.finish_reason, self._prefill.committed_len)
        deltas = self._consume(first)
        if deltas:
            yield deltas
        if self._finish_reason is None:
            async with aclosing(self._batches()) as batches:
                async for batch in batches:
                    deltas = self._consume(batch)
                    if deltas:
                        yield deltas
                    if self._finish_reason is not None:
                        break
        if self._finish_reason is None:
            raise UpstreamFailure("the upstream stream ended before the session finished", code="upstream_error")
        yield Finished(self._finish_reason, self.usage)

    def _consume(self, batch: Batch) -> list[TextDelta]:
        """Takes a batch token by token until the request finishes; returns one delta per token
        taken (its printable text may be empty), plus one for text flushed at the finish."""
        self._check_committed_len(batch)
        self._observe_round(batch)
        deltas: list[TextDelta] = []
        finish: str | None = None
        for token in batch.token_ids:
            self._completion.append(token)
            deltas.append(TextDelta(self._stop.push(self._detokenizer.push(token)), (token,)))
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
                tail = self._stop.push(self._detokenizer.flush()) + self._stop.flush()
                if self._stop.matched is not None:
                    finish = "stop"
                if tail and deltas:
                    deltas[-1] = TextDelta(deltas[-1].text + tail, deltas[-1].token_ids)
                elif tail:
                    deltas.append(TextDelta(tail, ()))
            self._finish_reason = finish
        if batch.mode is not None and deltas:
            self._stats.modes_used.add(batch.mode)
        return deltas

    @staticmethod
    def _upstream_finish(reason: int) -> str:
        if reason in _FINISH_REASONS:
            return _FINISH_REASONS[reason]
        raise UpstreamFailure(
            f"the upstream ended the session unexpectedly ({common_pb2.FinishReason.Name(reason)})",
            code="upstream_error",
        )

    def _expected_len(self, new_tokens: int) -> int:
        return len(self.request.prompt_token_ids) + len(self._completion) + new_tokens

    def _check_committed_len(self, batch: Batch) -> None:
        expected = self._expected_len(len(batch.token_ids))
        if batch.committed_len and batch.committed_len != expected:
            raise UpstreamFailure(
                f"session {self.session_id} is out of step with the target: {batch.committed_len} tokens "
                f"committed, but the gateway has received {expected}; refusing to return a text with gaps",
                code="upstream_error",
            )

    def _observe_round(self, batch: Batch) -> None:
        if batch.num_draft_tokens > 0:
            self._stats.rounds += 1
            self._stats.draft_tokens += batch.num_draft_tokens
            self._stats.accepted_tokens += batch.num_accepted
            self._deps.metrics.record_round(batch.num_draft_tokens, batch.num_accepted)

    def _observe_emission(self, num_tokens: int) -> None:
        """Inter-token latency as the client sees it: the gap since the previous delta, amortised
        over the delta's tokens (so an unpaced round of k tokens counts as k equal gaps)."""
        now = time.monotonic()
        if num_tokens and self._last_emit_at is not None:  # the first token's wait is the TTFT
            gap = (now - self._last_emit_at) / num_tokens
            for _ in range(num_tokens):
                self._deps.metrics.inter_token_latency.observe(gap)
        self._last_emit_at = now

    async def _release(self, session_id: str) -> None:
        try:
            await self._deps.target.release(session_id)
        except GatewayError as exc:
            # The target's session TTL frees it eventually; the request's outcome does not change.
            log.warning("could not release session %s: %s", session_id, exc.message)


async def _joined(source: AsyncIterator[list[TextDelta] | Finished]) -> AsyncIterator[Event]:
    """Unpaced: one delta per upstream batch, as it arrives."""
    async with aclosing(source) as items:
        async for item in items:
            if isinstance(item, list):
                yield TextDelta("".join(d.text for d in item), tuple(t for d in item for t in d.token_ids))
            else:
                yield item
