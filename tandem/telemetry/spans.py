"""Spans of tandem's own work: a draft session's speculation rounds, a generation request, mode switches.

Rounds
------
The draft's Speculate span carries one event per speculation round (``tandem.spec.round``: k,
accepted, verify time) for the first ``TANDEM_TRACE_ROUND_EVENTS`` rounds of a session (default
16); later rounds are aggregated, ``TANDEM_TRACE_ROUND_WINDOW`` rounds (default 16) per
``tandem.spec.rounds`` event, so a long session cannot flood its span. 0 events means aggregates
only. Totals are always set as span attributes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import NonRecordingSpan, Span, SpanKind, Status, StatusCode

from tandem.telemetry.propagation import context_from_metadata, run_in_context
from tandem.telemetry.tracing import _state

log = logging.getLogger(__name__)

ROUND_EVENTS_ENV = "TANDEM_TRACE_ROUND_EVENTS"
ROUND_WINDOW_ENV = "TANDEM_TRACE_ROUND_WINDOW"
DEFAULT_ROUND_EVENTS = 16
DEFAULT_ROUND_WINDOW = 16




def _env_int(name: str, default: int, env: Mapping[str, str] | None = None) -> int:
    raw = (os.environ if env is None else env).get(name, "")
    try:
        return max(0, int(raw)) if raw.strip() else default
    except ValueError:
        log.warning("%s=%r is not an integer; using %d", name, raw, default)
        return default


class RoundEvents:
    """Records a session's speculation rounds on a span: the first ``detailed`` rounds one event
    each, later ones aggregated ``window`` rounds per event; totals as span attributes at the end.

    Built on a non-recording span (tracing off, or a sampled-out trace) it records nothing.
    """

    def __init__(self, span: Span, detailed: int | None = None, window: int | None = None) -> None:
        self._span = span
        self._on = span.is_recording()
        self.detailed = _env_int(ROUND_EVENTS_ENV, DEFAULT_ROUND_EVENTS) if detailed is None else detailed
        self.window = max(1, _env_int(ROUND_WINDOW_ENV, DEFAULT_ROUND_WINDOW) if window is None else window)
        self.rounds = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.verify_s = 0.0
        self._pending: list[tuple[int, int, float]] = []
        self._pending_first = 0

    @classmethod
    def for_current_span(cls) -> RoundEvents:
        return cls(trace.get_current_span())

    def record(self, k: int, accepted: int, verify_s: float) -> None:
        """One verified round: ``k`` draft tokens proposed, ``accepted`` of them kept."""
        if not self._on:
            return
        index = self.rounds
        self.rounds += 1
        self.draft_tokens += k
        self.accepted += accepted
        self.verify_s += verify_s
        if index < self.detailed:
            self._span.add_event(
                "tandem.spec.round",
                {"tandem.round": index, "tandem.round.k": k, "tandem.round.accepted": accepted,
                 "tandem.round.verify_ms": round(verify_s * 1e3, 3)},
            )
            return
        if not self._pending:
            self._pending_first = index
        self._pending.append((k, accepted, verify_s))
        if len(self._pending) >= self.window:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        ks = sum(k for k, _, _ in self._pending)
        kept = sum(a for _, a, _ in self._pending)
        verify = [v for _, _, v in self._pending]
        self._span.add_event(
            "tandem.spec.rounds",
            {"tandem.rounds.first": self._pending_first, "tandem.rounds.count": len(self._pending),
             "tandem.rounds.draft_tokens": ks, "tandem.rounds.accepted": kept,
             "tandem.rounds.verify_ms_total": round(sum(verify) * 1e3, 3),
             "tandem.rounds.verify_ms_max": round(max(verify) * 1e3, 3)},
        )
        self._pending = []

    def finish(self) -> None:
        """Flushes the last aggregate and sets the session's totals on the span."""
        if not self._on:
            return
        self._flush()
        self._span.set_attributes({
            "tandem.spec.rounds": self.rounds,
            "tandem.spec.draft_tokens": self.draft_tokens,
            "tandem.spec.accepted_tokens": self.accepted,
            "tandem.spec.acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else 0.0,
            "tandem.spec.verify_ms_total": round(self.verify_s * 1e3, 3),
        })


# -- the gateway's request span ----------------------------------------------------------------


def record_mode_switch(mode: str, reason: str | None, completion_tokens: int) -> None:
    """A session's switch of decoding mode, as an event on the current (request) span: a fallback
    to autoregressive decoding (``tandem.session.fallback``, with its reason) or a return to
    speculation (``tandem.session.speculation_resumed``). No-op when the request is not traced."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    attributes: dict[str, Any] = {"tandem.mode": mode, "tandem.completion_tokens": completion_tokens}
    if reason:
        attributes["tandem.fallback.reason"] = reason
    span.add_event("tandem.session.fallback" if reason else "tandem.session.speculation_resumed", attributes)


def record_failover(reason: str, from_address: str, to_address: str, completion_tokens: int) -> None:
    """A session moved to another target (``tandem.session.failover``) as an event on the current
    (request) span. No-op when the request is not traced."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event("tandem.session.failover", {
            "tandem.failover.reason": reason, "tandem.failover.from": from_address,
            "tandem.failover.to": to_address, "tandem.completion_tokens": completion_tokens,
        })


class GenerationSpan:
    """The gateway's SERVER span of one generation request, named ``{operation} {model}`` with the
    GenAI semantic-convention attributes.

    ``operation`` is ``chat`` or ``text_completion``. The span is the parent of the upstream calls
    the request makes: run them inside :meth:`active` or through :meth:`stream`.
    """

    def __init__(self, span: Span, started: float) -> None:
        self.span = span
        self._ctx = trace.set_span_in_context(span)
        self._started = started
        self._ended = False
        self._recording = span.is_recording()

    @classmethod
    def start(
        cls,
        operation: str,
        model: str,
        *,
        carrier: Any = None,
        getter: Any = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> GenerationSpan:
        """Starts the span, continuing the client's trace when ``carrier`` (HTTP headers, or gRPC
        metadata with ``getter=None`` and a sequence carrier) holds a W3C ``traceparent``."""
        started = time.monotonic()
        if _state.tracer is None:
            return cls(NonRecordingSpan(trace.INVALID_SPAN_CONTEXT), started)
        if carrier is None:
            parent = None
        elif getter is None and not isinstance(carrier, Mapping):
            parent = context_from_metadata(carrier)
        else:
            parent = propagate.extract(carrier, getter=getter) if getter else propagate.extract(carrier)
        span = _state.tracer.start_span(
            f"{operation} {model}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                        "gen_ai.response.model": model, **(attributes or {})},
        )
        return cls(span, started)

    @contextlib.contextmanager
    def active(self) -> Iterator[GenerationSpan]:
        """Makes the span current (synchronous scope; awaits inside are fine within one task)."""
        token = otel_context.attach(self._ctx)
        try:
            yield self
        finally:
            otel_context.detach(token)

    def stream(self, agen: Any) -> AsyncIterator[Any]:
        """``agen`` iterated with the span current at every step (for streamed responses)."""
        return run_in_context(self._ctx, agen)

    def opened(self, request: Any, session_id: str) -> None:
        """The validated request (:class:`gateway.request.GenerationRequest`)."""
        if not self._recording:
            return
        sampling = request.sampling
        attributes: dict[str, Any] = {
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            "gen_ai.request.max_tokens": request.max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "tandem.session.id": session_id,
            "tandem.speculation": getattr(request.speculation, "value", str(request.speculation)),
        }
        if sampling.top_k:
            attributes["gen_ai.request.top_k"] = sampling.top_k
        if sampling.seed is not None:
            attributes["gen_ai.request.seed"] = sampling.seed
        if request.num_speculative_tokens:
            attributes["tandem.num_speculative_tokens"] = request.num_speculative_tokens
        self.span.set_attributes(attributes)

    def first_token(self) -> None:
        """The first token is known (Prefill answered): time to first token, in seconds."""
        if self._recording:
            self.span.set_attribute("gen_ai.response.time_to_first_chunk", time.monotonic() - self._started)

    def end(self, usage: Any = None, finish_reason: str | None = None, error: BaseException | None = None) -> None:
        """Ends the span once, with the usage (:class:`gateway.events.Usage`) when there is one."""
        if self._ended:
            return
        self._ended = True
        if not self._recording:
            return
        if usage is not None:
            stats = usage.speculative_decoding
            self.span.set_attributes({
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "gen_ai.usage.output_tokens": usage.completion_tokens,
                "tandem.spec.rounds": stats.rounds,
                "tandem.spec.draft_tokens": stats.draft_tokens,
                "tandem.spec.accepted_tokens": stats.accepted_tokens,
                "tandem.spec.acceptance_rate": stats.acceptance_rate,
                "tandem.spec.fallbacks": stats.fallbacks,
                "tandem.mode": stats.mode,
            })
        if finish_reason:
            self.span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        if error is not None and not isinstance(error, (GeneratorExit, asyncio.CancelledError)):
            self.span.set_attribute("error.type", getattr(error, "code", None) or type(error).__name__)
            self.span.set_status(Status(StatusCode.ERROR, str(getattr(error, "message", error))))
        self.span.end()
