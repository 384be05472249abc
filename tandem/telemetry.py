"""OpenTelemetry tracing shared by the three services: set-up from ``OTEL_*``, gRPC propagation, spans.

One request is one trace. The gateway opens a SERVER span per generation request (named and
attributed after the GenAI semantic conventions), every outgoing gRPC call gets a CLIENT span whose
W3C trace context travels in the call's metadata, and every traced gRPC server opens a SERVER span
that continues the caller's trace::

    gateway  chat gemma-3-270m                  SERVER, gen_ai.* attributes
      ├─ tandem.v1.TargetService/Prefill        CLIENT ─▶ target  .../Prefill SERVER
      ├─ tandem.v1.DraftService/Speculate       CLIENT ─▶ draft   .../Speculate SERVER, round events
      │                                                     └─ .../Verify CLIENT ─▶ target .../Verify SERVER
      └─ tandem.v1.TargetService/Release        CLIENT ─▶ target  .../Release SERVER

When tracing is on
------------------
* ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``: off.
* ``OTEL_TRACES_EXPORTER`` unset: on only when an OTLP endpoint is configured
  (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``). A service nobody
  configured does not try to reach a collector that is not there.
* ``OTEL_TRACES_EXPORTER=otlp`` (explicitly): on, with the SDK's default endpoint
  (``localhost:4317``) when none is given. ``console`` prints spans to stdout (debugging).
* OTLP goes over gRPC (``OTEL_EXPORTER_OTLP_*PROTOCOL`` other than ``grpc`` turns tracing off with
  a warning: no HTTP exporter is installed).

Everything else (headers, TLS, timeouts, batch sizes, sampler, resource attributes) is read by the
OpenTelemetry SDK from its standard variables. ``OTEL_SERVICE_NAME`` names the service; unset, it
is ``tandem-<service>``.

When tracing is off no SDK is set up, servers get no interceptor, clients add no metadata, and the
instrumented code paths cost one boolean test each (:func:`enabled`).

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
import inspect
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import NonRecordingSpan, Span, SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

TRACER_NAME = "tandem"

# gRPC codes a server span reports as an error (OpenTelemetry RPC conventions): the others are the
# client's mistake, an error only on the client's side.
_SERVER_ERROR_CODES = frozenset({
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS,
})

ROUND_EVENTS_ENV = "TANDEM_TRACE_ROUND_EVENTS"
ROUND_WINDOW_ENV = "TANDEM_TRACE_ROUND_WINDOW"
DEFAULT_ROUND_EVENTS = 16
DEFAULT_ROUND_WINDOW = 16


# -- set-up ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TracingDecision:
    """What the environment asks for: the exporters to set up (empty = tracing off) and why."""

    exporters: tuple[str, ...]
    reason: str

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def decide(env: Mapping[str, str] | None = None) -> TracingDecision:
    """Reads the ``OTEL_*`` variables (see the module docstring for the rules)."""
    env = os.environ if env is None else env
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return TracingDecision((), "OTEL_SDK_DISABLED is set")
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not names:
        if not endpoint:
            return TracingDecision((), "no OTLP endpoint configured")
        names = ["otlp"]
    if "none" in names:
        return TracingDecision((), "OTEL_TRACES_EXPORTER=none")
    chosen: list[str] = []
    for name in names:
        if name == "console":
            chosen.append(name)
        elif name == "otlp":
            protocol = (
                env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
            ).strip().lower()
            if protocol != "grpc":
                log.warning("OTLP protocol %r is not supported (only grpc); the otlp trace exporter is off", protocol)
                continue
            chosen.append(name)
        else:
            log.warning("unknown trace exporter %r in OTEL_TRACES_EXPORTER (supported: otlp, console, none)", name)
    if not chosen:
        return TracingDecision((), f"no supported exporter in OTEL_TRACES_EXPORTER={','.join(names)}")
    return TracingDecision(tuple(chosen), f"exporting to {', '.join(chosen)}")


class _State:
    """The process's tracing: None until :func:`setup_tracing` or :func:`install` turned it on."""

    provider: Any = None
    tracer: trace.Tracer | None = None


_state = _State()


def enabled() -> bool:
    """True when this process records spans; every instrumented path tests this first."""
    return _state.tracer is not None


def tracer() -> trace.Tracer:
    """The installed tracer (only meaningful while :func:`enabled`)."""
    return _state.tracer if _state.tracer is not None else trace.NoOpTracer()


def install(provider: Any) -> None:
    """Makes ``provider`` (an SDK ``TracerProvider``) this process's tracing, without touching
    OpenTelemetry's global provider (tests install an in-memory one and uninstall it)."""
    _state.provider = provider
    _state.tracer = provider.get_tracer(TRACER_NAME)


def uninstall() -> None:
    _state.provider = None
    _state.tracer = None


def setup_tracing(service: str, env: Mapping[str, str] | None = None) -> bool:
    """Sets up the SDK for service ``service`` ("target", "draft", "gateway") when the environment
    asks for it; returns whether tracing is on. Call :func:`shutdown_tracing` before exiting so the
    last spans are exported."""
    decision = decide(env)
    if not decision.enabled:
        log.debug("tracing off: %s", decision.reason)
        return False
    # Imported here: a service that does not trace never loads the SDK.
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    import tandem

    resource = Resource.create({"service.namespace": "tandem", "service.version": tandem.__version__})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"tandem-{service}"}))
    provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER(_ARG)
    for name in decision.exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    install(provider)
    log.info("tracing on (%s) as %s", decision.reason, resource.attributes.get(SERVICE_NAME))
    return True


def shutdown_tracing() -> None:
    """Exports what is buffered and stops the exporters (no-op when tracing is off)."""
    provider = _state.provider
    uninstall()
    if provider is not None:
        try:
            provider.shutdown()
        except Exception:  # never let telemetry turn a clean stop into a failure
            log.exception("stopping the trace exporter failed")


# -- propagation -------------------------------------------------------------------------------


class _MetadataGetter:
    """Reads a W3C header from gRPC invocation metadata (a sequence of key/value pairs)."""

    def get(self, carrier: Sequence[Any], key: str) -> list[str] | None:
        values = [value for k, value in carrier if k == key and isinstance(value, str)]
        return values or None

    def keys(self, carrier: Sequence[Any]) -> list[str]:
        return [k for k, _ in carrier]


_METADATA_GETTER = _MetadataGetter()


def context_from_metadata(metadata: Sequence[Any] | None) -> otel_context.Context:
    """The caller's trace context carried in gRPC metadata (the current context when none is)."""
    return propagate.extract(list(metadata or ()), getter=_METADATA_GETTER)


def _metadata_with_context(
    ctx: otel_context.Context, metadata: Iterable[tuple[str, str]]
) -> tuple[tuple[str, str], ...]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return (*metadata, *carrier.items())


def _split_method(full_method: str) -> tuple[str, str]:
    service, _, method = full_method.lstrip("/").partition("/")
    return service, method


def _rpc_attributes(full_method: str) -> dict[str, Any]:
    service, method = _split_method(full_method)
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def _server_attributes(address: str) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return {"server.address": address}
    return {"server.address": host.strip("[]"), "server.port": int(port)}


# -- client spans ------------------------------------------------------------------------------


class ClientCall:
    """The CLIENT span of one outgoing gRPC call and the metadata that carries its context.

    Pass ``metadata`` to the stub call and :meth:`end` the span when the call is over (unary:
    use it as a context manager; streams: end it when the stream ends or is cancelled).
    """

    def __init__(self, span: Span | None, metadata: tuple[tuple[str, str], ...] | None) -> None:
        self._span = span
        self.metadata = metadata
        self._ended = span is None

    def __enter__(self) -> ClientCall:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.end(exc)

    def end(self, error: BaseException | None = None, *, cancelled: bool = False) -> None:
        """Ends the span once (later calls do nothing). ``cancelled``: we cancelled the call
        ourselves (the stream was no longer needed), which is not an error."""
        if self._ended:
            return
        self._ended = True
        span = self._span
        assert span is not None
        code = _code_of(error)
        if cancelled and code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            code = grpc.StatusCode.CANCELLED
        elif code is not grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, _describe(error, code)))
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        span.end()


def client_call(full_method: str, address: str, metadata: Iterable[tuple[str, str]] = ()) -> ClientCall:
    """Starts the CLIENT span of a call to ``full_method`` ("/tandem.v1.TargetService/Verify") at
    ``address``, a child of the current span. With tracing off: no span, ``metadata`` unchanged."""
    extra = tuple(metadata)
    if _state.tracer is None:
        return ClientCall(None, extra or None)
    span = _state.tracer.start_span(
        full_method.lstrip("/"),
        kind=SpanKind.CLIENT,
        attributes={**_rpc_attributes(full_method), **_server_attributes(address)},
    )
    return ClientCall(span, _metadata_with_context(trace.set_span_in_context(span), extra))


def _code_of(error: BaseException | None) -> grpc.StatusCode:
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code()
    if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
        return grpc.StatusCode.CANCELLED
    code = getattr(error, "grpc_code", None)  # the gateway's errors know theirs
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def _describe(error: BaseException | None, code: grpc.StatusCode) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{code.name}: {error.details() or ''}"
    return f"{code.name}: {error!r}" if error is not None else code.name


# -- server spans ------------------------------------------------------------------------------


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """Opens a SERVER span for each call of the listed methods, continuing the caller's trace.

    The span is current while the handler runs, so the calls the handler makes (the draft's
    Verify stream) become its children. Health checks, reflection and ``Info`` are not listed by
    the services, so probes do not fill the trace store with one-span traces.
    """

    def __init__(self, methods: Iterable[str], tracer_: trace.Tracer | None = None) -> None:
        self._methods = frozenset(m if m.startswith("/") else f"/{m}" for m in methods)
        self._tracer = tracer_

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self._methods:
            return handler
        metadata = handler_call_details.invocation_metadata
        if handler.request_streaming and handler.response_streaming:
            field = "stream_stream"
        elif handler.request_streaming:
            field = "stream_unary"
        elif handler.response_streaming:
            field = "unary_stream"
        else:
            field = "unary_unary"
        behavior = getattr(handler, field)
        return handler._replace(**{field: self._wrap(behavior, method, metadata)})

    def _start(self, method: str, metadata: Sequence[Any] | None) -> Span:
        active = self._tracer or tracer()
        return active.start_span(
            method.lstrip("/"), context=context_from_metadata(metadata), kind=SpanKind.SERVER,
            attributes=_rpc_attributes(method),
        )

    def _wrap(self, behavior: Callable[..., Any], method: str, metadata: Sequence[Any] | None) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):

            async def traced_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                span = self._start(method, metadata)
                ctx = trace.set_span_in_context(span)
                error: BaseException | None = None
                try:
                    async for item in run_in_context(ctx, behavior(request, context)):
                        yield item
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    _end_server_span(span, context, error)

            return traced_stream

        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            span = self._start(method, metadata)
            error: BaseException | None = None
            token = otel_context.attach(trace.set_span_in_context(span))
            try:
                return await behavior(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                otel_context.detach(token)
                _end_server_span(span, context, error)

        return traced


def _end_server_span(span: Span, context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
    code: grpc.StatusCode | None = None
    try:
        code = context.code()  # what abort() or set_code() set
    except Exception:  # older grpc.aio contexts do not expose the code
        code = None
    if not isinstance(code, grpc.StatusCode):
        code = _code_of(error) if error is not None and not isinstance(error, grpc.aio.AbortError) else None
    if code is None:
        code = grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_ERROR_CODES:
        details = ""
        with contextlib.suppress(Exception):
            details = context.details() or ""
        if isinstance(details, bytes):
            details = details.decode("utf-8", "replace")
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name))
        if error is not None and not isinstance(error, grpc.aio.AbortError):
            span.record_exception(error)
    span.end()


def server_interceptors(methods: Iterable[str]) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors a service's gRPC server needs: none while tracing is off."""
    return [TracingServerInterceptor(methods)] if enabled() else []


def full_method(service_name: str, method: str) -> str:
    return f"/{service_name}/{method}"


async def run_in_context(ctx: otel_context.Context, stream: Any) -> AsyncIterator[Any]:
    """Iterates an async generator with ``ctx`` attached while it runs (not while the consumer
    holds an item), so the generator may be consumed from any task and closed from anywhere."""
    try:
        while True:
            token = otel_context.attach(ctx)
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                return
            finally:
                otel_context.detach(token)
            yield item
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            token = otel_context.attach(ctx)
            try:
                await close()
            finally:
                otel_context.detach(token)


# -- speculation rounds (draft) ----------------------------------------------------------------


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
