"""tandem.v1.GatewayService over gRPC against fake target and draft services."""

from __future__ import annotations

import asyncio
import math

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.v1 import common_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from gateway_fakes import (
    SCRIPT_TEXT,
    FakeDraftServicer,
    fake_stack,
    serve_fake,
    speculations_cancelled,
)

Request = gateway_pb2.GatewayServiceGenerateRequest
Message = gateway_pb2.ChatMessage


@pytest.fixture
async def channel(stack):
    async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
        yield ch


async def generate(ch, request):
    return [chunk async for chunk in gateway_pb2_grpc.GatewayServiceStub(ch).Generate(request)]


async def test_generate_streams_text_tokens_and_final_usage(stack, channel):
    chunks = await generate(channel, Request(prompt="Once upon", max_tokens=60, temperature=0))
    *deltas, last = chunks
    assert "".join(c.text for c in deltas) == SCRIPT_TEXT
    assert [t for c in deltas for t in c.token_ids] == stack.model.expected_tokens(1000)
    assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and not c.HasField("usage") for c in deltas)
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert last.usage.completion_tokens == len(stack.model.expected_tokens(1000))
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert last.usage.cached_prompt_tokens == 0
    spec = last.usage.speculative_decoding
    assert spec.mode == "speculative" and spec.rounds > 0 and spec.draft_tokens == 4 * spec.rounds
    stack.model.cached_tokens = 2
    *_, last = await generate(channel, Request(prompt="Once upon", max_tokens=3, temperature=0))
    assert last.usage.cached_prompt_tokens == 2
    await stack.wait_until_idle()


async def test_generate_with_messages_tokens_and_speculation_off(stack, channel):
    chat = await generate(channel, Request(messages=[Message(role="user", content="Hi")], max_tokens=5))
    assert chat[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and chat[-1].usage.completion_tokens == 5
    off = await generate(channel, Request(prompt_token_ids=[5, 6], speculation=common_pb2.SPECULATION_MODE_OFF,
                                          max_tokens=60))
    assert "".join(c.text for c in off) == SCRIPT_TEXT
    assert off[-1].usage.prompt_tokens == 2 and off[-1].usage.speculative_decoding.mode == "autoregressive"
    assert [name for name, _ in stack.model.rpcs[-3:]] == ["Prefill", "Generate", "Release"]


async def test_info_health_and_reflection(stack, channel):
    info = await gateway_pb2_grpc.GatewayServiceStub(channel).Info(gateway_pb2.GatewayServiceInfoRequest())
    assert (info.model, info.draft, info.num_speculative_tokens, info.max_context_len) == (
        stack.gateway.core.model.name, "fake", 4, 128)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tandem.v1.GatewayService"):
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = reflection.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    names = [s.name for s in (await call.read()).list_services_response.service]
    await call.done_writing()
    assert "tandem.v1.GatewayService" in names


async def test_health_is_not_serving_while_the_draft_is_down(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), draft_up=False) as stack:
        async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
            answer = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # ... yet "auto" requests are served by falling back to the target.
            chunks = await generate(ch, Request(prompt="x", max_tokens=3))
            assert chunks[-1].usage.speculative_decoding.mode == "autoregressive"
            assert chunks[-1].usage.speculative_decoding.fallbacks == 1
            assert chunks[-1].usage.speculative_decoding.fallback_reason == "draft_unavailable"


BAD_GRPC = [
    ("no prompt", Request(max_tokens=4)),
    ("two prompt kinds", Request(prompt="hi", prompt_token_ids=[5])),
    ("prompt longer than the context", Request(prompt_token_ids=[5] * 128)),
    ("out-of-vocabulary token", Request(prompt_token_ids=[5, 100000])),
    ("max_tokens 0", Request(prompt="hi", max_tokens=0)),
    ("max_tokens absurd", Request(prompt="hi", max_tokens=2**31 - 1)),
    ("temperature -1", Request(prompt="hi", temperature=-1)),
    ("temperature NaN", Request(prompt="hi", temperature=math.nan)),
    ("top_p 0", Request(prompt="hi", top_p=0)),
    ("top_p 2", Request(prompt="hi", top_p=2)),
    ("top_k -1", Request(prompt="hi", top_k=-1)),
    ("min_p 2", Request(prompt="hi", min_p=2)),
    ("min_p NaN", Request(prompt="hi", min_p=math.nan)),
    ("typical_p 0", Request(prompt="hi", typical_p=0)),
    ("typical_p NaN", Request(prompt="hi", typical_p=math.nan)),
    ("unknown model", Request(prompt="hi", model="no-such-model")),
    ("unknown speculation mode", Request(prompt="hi", speculation=99)),
    ("unknown stream smoothing", Request(prompt="hi", stream_smoothing=99)),
    ("num_speculative_tokens 0", Request(prompt="hi", num_speculative_tokens=0)),
    ("num_speculative_tokens 65", Request(prompt="hi", num_speculative_tokens=65)),
    ("unknown chat role", Request(messages=[Message(role="wizard", content="hi")])),
    ("empty stop string", Request(prompt="hi", stop=[""])),
]


async def test_stream_smoothing_override_keeps_tokens_and_usage(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), stream_smoothing="off", token_delay=0.005) as stack:
        async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
            raw = await generate(ch, Request(prompt="Once upon", max_tokens=60, temperature=0))
            paced = await generate(ch, Request(prompt="Once upon", max_tokens=60, temperature=0,
                                               stream_smoothing=gateway_pb2.STREAM_SMOOTHING_AUTO))
            off = await generate(ch, Request(prompt="Once upon", max_tokens=60, temperature=0,
                                             stream_smoothing=gateway_pb2.STREAM_SMOOTHING_OFF))
        await stack.wait_until_idle()
    tokens = [[t for c in chunks for t in c.token_ids] for chunks in (raw, paced, off)]
    assert tokens[0] == tokens[1] == tokens[2] == stack.model.expected_tokens(1000)
    assert raw[-1].usage == paced[-1].usage == off[-1].usage
    # Raw and OFF: one chunk per round of several tokens; paced: one chunk per token.
    assert len(paced) > len(raw) == len(off)
    assert max(len(c.token_ids) for c in paced) == 1


async def test_bad_input_table_gets_invalid_argument_and_service_goes_on(stack, channel):
    for name, request in BAD_GRPC:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(channel, request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert info.value.details(), name
        ok = await generate(channel, Request(prompt="Hello", max_tokens=2))
        assert ok[-1].usage.completion_tokens == 2, name
    assert stack.metric("tandem_requests_total", status="invalid") == len(BAD_GRPC)
    await stack.wait_until_idle()


async def test_overload_is_resource_exhausted(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), token_delay=0.02, max_concurrent_requests=1) as stack:
        async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
            stub = gateway_pb2_grpc.GatewayServiceStub(ch)
            first = stub.Generate(Request(prompt="Go", max_tokens=20, ignore_eos=True))
            await first.read()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(ch, Request(prompt="hi", max_tokens=2))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            rest = []
            while (chunk := await first.read()) != grpc.aio.EOF:
                rest.append(chunk)
            assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            await stack.wait_until_idle()
            assert (await generate(ch, Request(prompt="hi", max_tokens=2)))[-1].usage.completion_tokens == 2


async def test_client_cancel_releases_the_session(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), token_delay=0.02) as stack:
        async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
            call = gateway_pb2_grpc.GatewayServiceStub(ch).Generate(Request(prompt="Go", max_tokens=100,
                                                                            ignore_eos=True))
            for _ in range(3):
                await call.read()
            call.cancel()
            await stack.wait_until_idle()
        (session_id,) = stack.model.released
        assert await speculations_cancelled(stack.model) == [session_id]
        assert stack.metric("tandem_requests_total", status="abort") == 1


async def test_upstream_unavailable_is_unavailable(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), target_address="127.0.0.1:1") as stack:
        async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(ch, Request(prompt="hi"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "target service" in info.value.details()


async def test_stopping_the_gateway_ends_streams_with_unavailable(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), token_delay=0.02) as stack:
        async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
            call = gateway_pb2_grpc.GatewayServiceStub(ch).Generate(Request(prompt="Go", max_tokens=100,
                                                                            ignore_eos=True))
            await call.read()
            stopping = asyncio.ensure_future(stack.gateway.stop(grace=0.1))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() != grpc.aio.EOF:
                    pass
            await stopping
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == "the gateway is shutting down"
        assert len(stack.model.released) == 1 and not stack.model.sessions and stack.sessions_active() == 0


async def test_health_follows_the_draft_coming_back(tokenizer, tiny_dir):
    # A periodic check far in the future: readiness must come from the check /health makes.
    async with fake_stack(tokenizer, str(tiny_dir), draft_up=False, health_interval_s=600) as stack:
        draft_port = int(stack.gateway.core.monitor.drafts.spec.rsplit(":", 1)[1])
        async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            check = health_pb2.HealthCheckRequest(service="tandem.v1.GatewayService")
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            draft_server, _ = await serve_fake(draft_pb2_grpc.add_DraftServiceServicer_to_server,
                                               FakeDraftServicer(stack.model), "tandem.v1.DraftService", draft_port)
            try:
                async with httpx.AsyncClient(base_url=stack.base_url) as client:
                    # The gateway's channel reconnects after a short backoff.
                    for _ in range(100):
                        if (await client.get("/health")).status_code == 200:
                            break
                        await asyncio.sleep(0.05)
                    else:
                        raise AssertionError("/health never turned 200 after the draft came back")
                assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
                # "auto" speculates again now that the draft is back.
                chunks = await generate(ch, Request(prompt="x", max_tokens=8))
                assert chunks[-1].usage.speculative_decoding.mode == "speculative"
            finally:
                await draft_server.stop(None)
