"""API keys (gateway.auth): unit checks, the HTTP API with the OpenAI SDK, gRPC, and `tandem serve`
passing keys to the gateway without putting them on a command line."""

from __future__ import annotations

import logging

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.auth import ApiKeys, key_id
from gateway.errors import Unauthenticated
from gateway_fakes import fake_stack
from tandem.config import ServeSettings
from tandem.supervisor import child_commands
from tandem.v1 import gateway_pb2, gateway_pb2_grpc

KEYS = "sk-first-0123456789,sk-second-abcdef"


def test_keys_are_checked_whole_and_known_by_id_only(tmp_path):
    keys = ApiKeys.load(KEYS)
    assert keys.enabled and len(keys) == 2
    assert keys.check("Bearer sk-second-abcdef") == key_id("sk-second-abcdef")
    assert keys.check("bearer   sk-first-0123456789 ") == key_id("sk-first-0123456789")
    for header in (None, "", "Bearer", "Basic sk-first-0123456789", "Bearer sk-first-012345678",
                   "Bearer sk-first-0123456789x", "sk-first-0123456789"):
        with pytest.raises(Unauthenticated) as info:
            keys.check(header)
        assert "sk-first" not in info.value.message
    assert ApiKeys.load("").check(None) is None  # no keys: everybody
    path = tmp_path / "keys"
    path.write_text("# ops team\nsk-file-1\n\n  sk-file-2  \n")
    from_file = ApiKeys.load("sk-flag", str(path))
    assert len(from_file) == 3 and from_file.check("Bearer sk-file-2")
    assert len(key_id("x")) == 8


async def test_http_routes_need_a_key_but_health(tokenizer, tiny_dir, caplog):
    caplog.set_level(logging.DEBUG)
    async with fake_stack(tokenizer, str(tiny_dir), api_keys=KEYS) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url) as client:
            refused = await client.get("/v1/models")
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert refused.json()["error"]["type"] == "invalid_request_error"
            wrong = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                      headers={"Authorization": "Bearer sk-guess"})
            assert wrong.status_code == 401
            # A body that does not parse, without a key: 401 (not a 400 that would describe the body).
            garbled = await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
            assert garbled.status_code == 401 and garbled.json()["error"]["code"] == "invalid_api_key"
            keyed = await client.post("/v1/completions", content=b"{not json",
                                      headers={"content-type": "application/json",
                                               "Authorization": "Bearer sk-first-0123456789"})
            assert keyed.status_code == 400
            ok = await client.get("/v1/models", headers={"Authorization": "Bearer sk-first-0123456789"})
            assert ok.status_code == 200
            for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
                assert (await client.post(path, json=body)).status_code == 401
                assert (await client.post(path, json=body, headers={"Authorization": "Bearer sk-first-0123456789"})
                        ).status_code == 200
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/metrics")).status_code == 200  # open unless --metrics-auth
        assert stack.metric("tandem_requests_total", status="unauthenticated") == 5
        base = f"{stack.base_url}/v1"
        sdk = openai.AsyncOpenAI(base_url=base, api_key="sk-second-abcdef")
        completion = await sdk.completions.create(model=stack.gateway.core.model.name, prompt="Once", max_tokens=5,
                                                  temperature=0)
        assert completion.usage.completion_tokens == 5
        chunks = [c async for c in await sdk.completions.create(model=stack.gateway.core.model.name,
                                                                prompt="Once", max_tokens=5, stream=True)]
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=base, api_key="sk-guess", max_retries=0).models.list()
    assert not any(secret in caplog.text for secret in KEYS.split(","))


async def test_metrics_auth_keys_the_metrics_route(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), api_keys=KEYS, metrics_auth=True) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url) as client:
            assert (await client.get("/metrics")).status_code == 401
            keyed = await client.get("/metrics", headers={"Authorization": "Bearer sk-first-0123456789"})
            assert keyed.status_code == 200 and "tandem_requests_total" in keyed.text


async def test_grpc_calls_need_a_key_but_health(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), api_keys=KEYS) as stack:
        async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            request = gateway_pb2.GatewayServiceGenerateRequest(prompt="Once", max_tokens=4, temperature=0.0)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(request):
                    pass
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in info.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Info(gateway_pb2.GatewayServiceInfoRequest(), metadata=(("authorization", "Bearer no"),))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            key = (("authorization", "Bearer sk-second-abcdef"),)
            chunks = [c async for c in stub.Generate(request, metadata=key)]
            assert sum(len(c.token_ids) for c in chunks) == 4
            assert (await stub.Info(gateway_pb2.GatewayServiceInfoRequest(), metadata=key)).model
            assert stack.metric("tandem_requests_total", status="unauthenticated") == 2
            health = health_pb2_grpc.HealthStub(channel)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING


def test_serve_hands_the_keys_to_the_gateway_in_its_environment(tmp_path):
    settings = ServeSettings(api_keys=KEYS, api_key_file=str(tmp_path / "more"), metrics_auth=True)
    children = {child.name: child for child in child_commands(settings)}
    gateway = children["gateway"]
    assert gateway.env == {"TANDEM_API_KEYS": KEYS, "TANDEM_LOG_NAME": "gateway"}
    assert not any(secret in " ".join(gateway.argv) for secret in KEYS.split(","))
    assert gateway.argv[gateway.argv.index("--api-key-file") + 1] == str(tmp_path / "more")
    assert "--metrics-auth" in gateway.argv
    assert children["target"].env == {"TANDEM_LOG_NAME": "target"} and "TANDEM_API_KEYS" not in children["draft"].env
    assert KEYS not in repr(settings)


def test_tandem_serve_with_an_api_key(tiny_dir, tiny_draft_dir):
    """The whole stack as a user starts it: `tandem serve --api-key KEY`; the key never shows in
    its output or on any child's command line."""
    import psutil

    from stack import running_stack

    key = "sk-serve-7f3a9c"
    with running_stack(str(tiny_dir), str(tiny_draft_dir), extra_args=("--api-key", key)) as stack:
        sdk = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key)
        completion = sdk.completions.create(model=sdk.models.list().data[0].id, prompt="Once", max_tokens=6,
                                            temperature=0)
        assert completion.usage.completion_tokens == 6
        assert httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 401
        assert httpx.get(f"{stack.base_url}/health").status_code == 200
        for child in psutil.Process(stack.process.pid).children():
            assert key not in " ".join(child.cmdline())
        assert "API keys" in stack.log() and key not in stack.log()


# ---- per-key limits -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_key_gets_its_own_share_of_concurrency_and_rate():
    from gateway.admission import AdmissionControl
    from gateway.errors import Overloaded

    clock = Clock()
    control = AdmissionControl(10, per_key=2, rate_per_minute=3, clock=clock)
    a1, a2 = control.admit("a"), control.admit("a")
    with pytest.raises(Overloaded) as info:
        control.admit("a")  # a third in flight
    assert info.value.retry_after_s == 1.0 and "a (key id)" in info.value.message
    b = control.admit("b")  # another key is not held back
    a1.release()
    a1.release()  # idempotent
    a3 = control.admit("a")  # the third this minute
    a3.release()
    with pytest.raises(Overloaded) as info:
        control.admit("a")  # room in flight, but past 3 a minute
    assert info.value.code == "rate_limit_exceeded" and info.value.retry_after_s == pytest.approx(20.0)
    clock.now = 20.0  # one request's worth refilled
    a4 = control.admit("a")
    for ticket in (a2, a4, b):
        ticket.release()
    assert control.in_flight == 0 and control.by_key == {}
    assert AdmissionControl(1).admit(None)  # no keys: only the gateway's own limit


async def test_http_and_grpc_refuse_a_key_past_its_share_with_a_retry_hint(tokenizer, tiny_dir):
    import asyncio

    async with fake_stack(tokenizer, str(tiny_dir), api_keys=KEYS, max_concurrent_per_key=1,
                          token_delay=0.05) as stack:
        first = {"Authorization": "Bearer sk-first-0123456789"}
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            body = {"prompt": "Once", "max_tokens": 20, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body, headers=first) as running:
                assert running.status_code == 200
                await asyncio.sleep(0.2)
                refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=first)
                assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                other = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                          headers={"Authorization": "Bearer sk-second-abcdef"})
                assert other.status_code == 200
                async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
                    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                    call = stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(prompt="x", max_tokens=2),
                                         metadata=(("authorization", "Bearer sk-first-0123456789"),))
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        async for _ in call:
                            pass
                    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert dict(info.value.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
                async for _ in running.aiter_bytes():
                    pass
        await stack.wait_until_idle()
        assert stack.gateway.core.admission.by_key == {}
