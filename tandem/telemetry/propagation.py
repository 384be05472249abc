"""W3C trace context across gRPC: a CLIENT span per outgoing call whose context travels in the call's
metadata, and a SERVER span per traced call that continues the caller's trace."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from tandem.telemetry.tracing import _state, enabled, tracer

log = logging.getLogger(__name__)

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
