"""One request through the real three-process stack is one trace, received by a real OTLP endpoint.

The receiver is opentelemetry-proto's ``TraceService`` served by grpc on a free port; the stack is
``tandem serve`` with the standard ``OTEL_*`` variables pointing at it. The client sends its own
``traceparent`` so the test also checks that the gateway continues a caller's trace.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from unittest import mock

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2 as otlp_common
from opentelemetry.proto.trace.v1 import trace_pb2 as otlp_trace

from stack import running_stack
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

SERVER, CLIENT = otlp_trace.Span.SPAN_KIND_SERVER, otlp_trace.Span.SPAN_KIND_CLIENT


def _value(v: otlp_common.AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    attributes: dict
    events: list[tuple[str, dict]]


@dataclass
class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps what it is sent."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    received.append(ReceivedSpan(
                        service=resource.get("service.name", ""),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=span.kind,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        events=[(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in span.events],
                    ))
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sink = OtlpReceiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sink.port = port
    yield sink
    server.stop(None)


def otel_env(endpoint_port: int) -> dict[str, str]:
    """What a user sets to trace a stack: an endpoint (and a short batch delay, for the test)."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{endpoint_port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture(scope="module")
def traced_stack(receiver, tiny_dir, tiny_draft_dir):
    with mock.patch.dict(os.environ):  # restored afterwards
        for key in [k for k in os.environ if k.startswith("OTEL_")]:
            del os.environ[key]
        os.environ.update(otel_env(receiver.port))
        with running_stack(str(tiny_dir), str(tiny_draft_dir), k=3) as stack:
            yield stack


def wait_for(
    receiver: OtlpReceiver, trace_id: str, expected: set[tuple[str, str]], timeout_s: float = 30.0
) -> list[ReceivedSpan]:
    """The trace's spans once every (service, span name) expected has arrived and no span's
    parent is still missing (each process exports on its own schedule)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = receiver.trace(trace_id)
        ids = {s.span_id for s in spans}
        roots = [s for s in spans if s.parent_id not in ids]
        if expected <= {(s.service, s.name) for s in spans} and len(roots) == 1:
            return spans
        assert time.monotonic() < deadline, [(s.service, s.name) for s in spans]
        time.sleep(0.1)


def one(spans: list[ReceivedSpan], service: str, name: str, kind: int) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name and s.kind == kind]
    assert len(found) == 1, (service, name, [(s.service, s.name, s.kind) for s in spans])
    return found[0]


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def assert_tree(spans: list[ReceivedSpan], client_span_id: str) -> None:
    """Every span hangs off another span of the trace, except the gateway's, whose parent is the client."""
    ids = {s.span_id for s in spans}
    for s in spans:
        assert s.parent_id in ids or (s.service == "tandem-gateway" and s.parent_id == client_span_id), s


def test_http_request_is_one_trace_across_gateway_draft_and_target(traced_stack, receiver) -> None:
    model = httpx.get(f"{traced_stack.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    trace_id, client_span, header = traceparent()
    reply = httpx.post(
        f"{traced_stack.base_url}/v1/completions",
        json={"model": model, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
              "ignore_eos": True, "speculation": "on"},
        headers={"traceparent": header},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    spans = wait_for(receiver, trace_id, {
        ("tandem-gateway", f"text_completion {model}"),
        *{("tandem-target", f"tandem.v1.TargetService/{m}") for m in ("Prefill", "Verify", "Release")},
        ("tandem-draft", "tandem.v1.DraftService/Speculate"),
        ("tandem-draft", "tandem.v1.TargetService/Verify"),
    })
    assert {s.service for s in spans} == {"tandem-gateway", "tandem-draft", "tandem-target"}
    assert_tree(spans, client_span)

    root = one(spans, "tandem-gateway", f"text_completion {model}", SERVER)
    assert root.parent_id == client_span
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.request.model"] == model
    assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 12
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < root.attributes["gen_ai.response.time_to_first_chunk"] < 60
    assert root.attributes["tandem.spec.rounds"] == usage["speculative_decoding"]["rounds"] > 0

    # gateway -> target: Prefill and Release
    for method in ("Prefill", "Release"):
        client = one(spans, "tandem-gateway", f"tandem.v1.TargetService/{method}", CLIENT)
        # The draft may release the session too (idempotent) when its Speculate call ends by
        # cancellation, under its own span; the gateway's call has exactly one server span.
        server = one(
            [s for s in spans if s.parent_id == client.span_id], "tandem-target", f"tandem.v1.TargetService/{method}", SERVER
        )
        assert client.parent_id == root.span_id
        assert server.attributes["rpc.system"] == "grpc" and server.attributes["rpc.grpc.status_code"] == 0

    # gateway -> draft -> target: Speculate, then the session's Verify stream
    speculate_client = one(spans, "tandem-gateway", "tandem.v1.DraftService/Speculate", CLIENT)
    speculate = one(spans, "tandem-draft", "tandem.v1.DraftService/Speculate", SERVER)
    verify_client = one(spans, "tandem-draft", "tandem.v1.TargetService/Verify", CLIENT)
    verify = one(spans, "tandem-target", "tandem.v1.TargetService/Verify", SERVER)
    assert speculate_client.parent_id == root.span_id
    assert speculate.parent_id == speculate_client.span_id
    assert verify_client.parent_id == speculate.span_id
    assert verify.parent_id == verify_client.span_id

    # one event per round (k, accepted, verify time), and the totals
    rounds = [attrs for name, attrs in speculate.events if name == "tandem.spec.round"]
    assert rounds and [r["tandem.round"] for r in rounds] == list(range(len(rounds)))
    for r in rounds:
        assert 0 <= r["tandem.round.accepted"] <= r["tandem.round.k"] <= 3 and r["tandem.round.verify_ms"] >= 0
    assert speculate.attributes["tandem.spec.rounds"] == len(rounds)
    assert speculate.attributes["tandem.spec.accepted_tokens"] == sum(r["tandem.round.accepted"] for r in rounds)


def test_grpc_autoregressive_request_traces_the_generate_hop(traced_stack, receiver) -> None:
    trace_id, client_span, header = traceparent()
    with grpc.insecure_channel(f"127.0.0.1:{traced_stack.grpc_port}") as channel:
        chunks = list(gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
            gateway_pb2.GatewayServiceGenerateRequest(
                prompt="hello", max_tokens=6, temperature=0.0, ignore_eos=True,
                speculation=common_pb2.SPECULATION_MODE_OFF),
            metadata=(("traceparent", header),), timeout=60,
        ))
    assert chunks[-1].usage.completion_tokens == 6

    spans = wait_for(receiver, trace_id, {
        ("tandem-gateway", "tandem.v1.TargetService/Generate"),
        *{("tandem-target", f"tandem.v1.TargetService/{m}") for m in ("Prefill", "Generate", "Release")},
    })
    assert {s.service for s in spans} == {"tandem-gateway", "tandem-target"}  # the draft is not involved
    assert_tree(spans, client_span)
    root = next(s for s in spans if s.service == "tandem-gateway" and s.kind == SERVER)
    assert root.parent_id == client_span
    assert root.attributes["rpc.system"] == "grpc"
    assert root.attributes["gen_ai.usage.output_tokens"] == 6
    assert root.attributes["tandem.mode"] == "autoregressive"
    client = one(spans, "tandem-gateway", "tandem.v1.TargetService/Generate", CLIENT)
    server = one(spans, "tandem-target", "tandem.v1.TargetService/Generate", SERVER)
    assert client.parent_id == root.span_id and server.parent_id == client.span_id


def test_health_probes_and_info_make_no_traces(traced_stack, receiver) -> None:
    """Probes (health every few seconds, Info) would otherwise fill the trace store."""
    time.sleep(0.5)
    names = {s.name for s in receiver.spans}
    assert not any("Health" in n or n.endswith("/Info") for n in names), names
