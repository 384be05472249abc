"""tandem.telemetry in one process: when tracing turns on, the gRPC interceptor and client spans
(parent links, status codes, every handler shape), round events, and the off switch."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tandem import telemetry


@pytest.mark.parametrize(
    ("env", "exporters"),
    [
        ({}, ()),  # nothing configured: off, no collector is dialled
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://jaeger:4317"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317", "OTEL_TRACES_EXPORTER": "none"}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317", "OTEL_SDK_DISABLED": "true"}, ()),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),  # asked for explicitly: the SDK's default endpoint
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
        ({"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ("otlp", "console")),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, ()),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, ()),
    ],
)
def test_decide_reads_the_standard_variables(env, exporters) -> None:
    decision = telemetry.decide(env)
    assert decision.exporters == exporters and decision.enabled == bool(exporters), decision.reason


def test_tracing_off_sets_up_nothing() -> None:
    assert telemetry.setup_tracing("target", {"OTEL_TRACES_EXPORTER": "none"}) is False
    assert not telemetry.enabled()
    assert telemetry.server_interceptors(["/x.Y/Z"]) == []
    call = telemetry.client_call("/x.Y/Z", "127.0.0.1:1", (("tandem-session-id", "s"),))
    assert call.metadata == (("tandem-session-id", "s"),)  # untouched: no traceparent added
    assert telemetry.client_call("/x.Y/Z", "127.0.0.1:1").metadata is None
    call.end()
    span = telemetry.GenerationSpan.start("chat", "m", carrier={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    assert not span.span.is_recording()
    span.end()
    # No span current: a fallback event is dropped silently.
    telemetry.record_mode_switch("autoregressive", "draft_unavailable", 3)


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.install(provider)
    yield exporter
    telemetry.uninstall()
    provider.shutdown()


def test_round_events_detail_then_aggregate(spans) -> None:
    span = telemetry.tracer().start_span("speculate")
    rounds = telemetry.RoundEvents(span, detailed=2, window=3)
    for i in range(9):
        rounds.record(k=4, accepted=i % 5, verify_s=0.001 * (i + 1))
    rounds.finish()
    span.end()
    (speculate_span,) = spans.get_finished_spans()
    events = [(e.name, dict(e.attributes)) for e in speculate_span.events]
    assert [name for name, _ in events] == ["tandem.spec.round"] * 2 + ["tandem.spec.rounds"] * 3
    assert events[1][1] == {"tandem.round": 1, "tandem.round.k": 4, "tandem.round.accepted": 1,
                            "tandem.round.verify_ms": 2.0}
    assert [(a["tandem.rounds.first"], a["tandem.rounds.count"]) for _, a in events[2:]] == [(2, 3), (5, 3), (8, 1)]
    assert events[2][1]["tandem.rounds.accepted"] == 2 + 3 + 4 and events[2][1]["tandem.rounds.verify_ms_max"] == 5.0
    assert speculate_span.attributes["tandem.spec.rounds"] == 9
    assert speculate_span.attributes["tandem.spec.accepted_tokens"] == sum(i % 5 for i in range(9))
    assert speculate_span.attributes["tandem.spec.draft_tokens"] == 36


def test_mode_switches_are_events_on_the_request_span(spans) -> None:
    span = telemetry.GenerationSpan.start("chat", "tiny")
    with span.active():
        telemetry.record_mode_switch("autoregressive", "low_acceptance", 12)
        telemetry.record_mode_switch("speculative", None, 40)
    span.end()
    (ended,) = spans.get_finished_spans()
    assert ended.name == "chat tiny" and ended.kind is SpanKind.SERVER
    assert [(e.name, dict(e.attributes)) for e in ended.events] == [
        ("tandem.session.fallback", {"tandem.mode": "autoregressive", "tandem.completion_tokens": 12,
                                     "tandem.fallback.reason": "low_acceptance"}),
        ("tandem.session.speculation_resumed", {"tandem.mode": "speculative", "tandem.completion_tokens": 40}),
    ]


def test_round_events_on_an_untraced_span_record_nothing() -> None:
    rounds = telemetry.RoundEvents.for_current_span()
    rounds.record(4, 2, 0.01)
    rounds.finish()
    assert rounds.rounds == 0


# -- the interceptor on a real grpc.aio server ---------------------------------------------------

SERVICE = "test.Echo"


def _handlers():
    async def unary(request: bytes, context) -> bytes:
        if request == b"fail":
            await context.abort(grpc.StatusCode.INTERNAL, "broken")
        if request == b"bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "your fault")
        # A call made inside the handler is a child of the server span.
        with telemetry.client_call("/test.Next/Hop", "127.0.0.1:9"):
            pass
        return request

    async def stream_out(request: bytes, context):
        for i in range(3):
            yield request + bytes([48 + i])

    async def written(request: bytes, context) -> None:  # the context.write style (draft's Speculate)
        await context.write(request)
        await context.write(request)

    async def bidi(requests, context):
        async for request in requests:
            yield request.upper()

    identity = dict(request_deserializer=None, response_serializer=None)
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, **identity),
        "StreamOut": grpc.unary_stream_rpc_method_handler(stream_out, **identity),
        "Written": grpc.unary_stream_rpc_method_handler(written, **identity),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi, **identity),
        "Untraced": grpc.unary_unary_rpc_method_handler(unary, **identity),
    })


@pytest.fixture
async def echo(spans):
    traced = [telemetry.full_method(SERVICE, m) for m in ("Unary", "StreamOut", "Written", "Bidi")]
    server = grpc.aio.server(interceptors=telemetry.server_interceptors(traced))
    server.add_generic_rpc_handlers([_handlers()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield channel, f"127.0.0.1:{port}"
    await channel.close()
    await server.stop(None)


async def finished_span(exporter: InMemorySpanExporter, name: str, kind: SpanKind):
    return await finished(exporter, lambda s: s.name == name and s.kind is kind)


async def test_every_handler_shape_continues_the_callers_trace(echo, spans) -> None:
    channel, address = echo
    parent = telemetry.tracer().start_span("caller")
    with trace.use_span(parent, end_on_exit=True):
        for method, call in (
            ("Unary", lambda md: channel.unary_unary(f"/{SERVICE}/Unary")(b"hi", metadata=md)),
            ("StreamOut", lambda md: _collect(channel.unary_stream(f"/{SERVICE}/StreamOut")(b"x", metadata=md))),
            ("Written", lambda md: _collect(channel.unary_stream(f"/{SERVICE}/Written")(b"w", metadata=md))),
            ("Bidi", lambda md: _collect(channel.stream_stream(f"/{SERVICE}/Bidi")(_requests(), metadata=md))),
        ):
            with telemetry.client_call(f"/{SERVICE}/{method}", address) as client:
                await call(client.metadata)
    ended = spans.get_finished_spans()
    caller = next(s for s in ended if s.name == "caller")
    for method in ("Unary", "StreamOut", "Written", "Bidi"):
        name = f"{SERVICE}/{method}"
        client = next(s for s in ended if s.name == name and s.kind is SpanKind.CLIENT)
        server = await finished_span(spans, name, SpanKind.SERVER)
        assert client.parent.span_id == caller.context.span_id
        assert server.parent.span_id == client.context.span_id and server.context.trace_id == caller.context.trace_id
        assert server.attributes["rpc.grpc.status_code"] == 0 and server.attributes["rpc.method"] == method
        assert client.attributes["server.address"] == "127.0.0.1"
    hop = await finished_span(spans, "test.Next/Hop", SpanKind.CLIENT)
    unary_server = await finished_span(spans, f"{SERVICE}/Unary", SpanKind.SERVER)
    assert hop.parent.span_id == unary_server.context.span_id


async def test_status_codes_and_untraced_methods(echo, spans) -> None:
    channel, address = echo
    for payload, code in ((b"fail", grpc.StatusCode.INTERNAL), (b"bad", grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.aio.AioRpcError):
            with telemetry.client_call(f"/{SERVICE}/Unary", address) as client:
                await channel.unary_unary(f"/{SERVICE}/Unary")(payload, metadata=client.metadata)
        # The client may see the status a moment before the server's handler has unwound.
        server = await finished(spans, lambda s: s.kind is SpanKind.SERVER)
        client_span = await finished(spans, lambda s: s.kind is SpanKind.CLIENT and s.name.endswith("Unary"))
        assert server.attributes["rpc.grpc.status_code"] == code.value[0]
        # The server owns INTERNAL; INVALID_ARGUMENT is the caller's error, not the server's.
        assert (server.status.status_code is StatusCode.ERROR) == (code is grpc.StatusCode.INTERNAL)
        assert client_span.status.status_code is StatusCode.ERROR
        spans.clear()
    await channel.unary_unary(f"/{SERVICE}/Untraced")(b"hi")
    assert [s.name for s in spans.get_finished_spans()] == ["test.Next/Hop"]  # only the inner call's span


async def finished(exporter: InMemorySpanExporter, predicate, timeout_s: float = 10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        found = [s for s in exporter.get_finished_spans() if predicate(s)]
        if found:
            return found[0]
        assert asyncio.get_running_loop().time() < deadline, [s.name for s in exporter.get_finished_spans()]
        await asyncio.sleep(0.01)


async def _collect(call) -> list:
    return [item async for item in call]


async def _requests():
    for item in (b"a", b"b"):
        yield item
