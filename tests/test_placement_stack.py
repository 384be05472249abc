"""Placement by measured speed across real services (in process, real gRPC, the tiny model): a
gateway with two lookup drafts of one target, one across a 20 ms hop (the bench's delaying proxy)
and one beside the target, sends the legs to the near one once both are measured; the output is
the target's whatever draft served it."""

from __future__ import annotations

import httpx
import pytest
from draft_fakes import load_tiny

from draft_service.main import start_draft
from draft_service.proposers.ngram import NgramProposer
from gateway.main import start_gateway
from tandem.config import GatewaySettings
from tandem.models import load_tokenizer
from tandem.tools.bench.delay_proxy import DelayProxy

target_main = pytest.importorskip("target_service.main")
target_engine = pytest.importorskip("target_service.engine")


async def test_legs_go_to_the_draft_beside_the_target_and_the_output_is_the_targets(tiny_dir):
    target = load_tiny(tiny_dir)
    served = await target_main.start_target(target_engine.TargetEngine(target))
    address = f"127.0.0.1:{served.port}"
    proxy = await DelayProxy(address, delay_s=0.02).start()
    far = await start_draft(lambda info: NgramProposer(), proxy.address, num_speculative_tokens=3, target_wait_s=10)
    near = await start_draft(lambda info: NgramProposer(), address, num_speculative_tokens=3, target_wait_s=10)
    far_address, near_address = f"127.0.0.1:{far.port}", f"127.0.0.1:{near.port}"
    settings = GatewaySettings(target_model=str(tiny_dir), target_address=address,
                               draft_address=f"{far_address},{near_address}", http_port=0, grpc_port=0,
                               num_speculative_tokens=3, log_level="warning", fallback_adaptive=False,
                               draft_breaker_cooldown_s=0.0)
    gateway = await start_gateway(settings, load_tokenizer(str(tiny_dir)))
    try:
        body = {"model": gateway.core.model.name, "prompt": "ab ab ab ab", "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.http_port}", timeout=60) as client:
            expected = (await client.post("/v1/completions", json={**body, "speculation": "off"})).json()
            texts = []
            for _ in range(6):
                reply = (await client.post("/v1/completions", json={**body, "speculation": "on"})).json()
                assert reply["usage"]["speculative_decoding"]["mode"] == "speculative"
                texts.append(reply["choices"][0]["text"])
            health = (await client.get("/health")).json()
        assert texts == [expected["choices"][0]["text"]] * 6
        speeds = {m["address"]: m["tokens_per_s"][address] for m in health["draft"]["members"]}
        assert speeds[near_address] > speeds[far_address]
        # Each draft had a leg (one request is one leg with speculation "on"); then the near one
        # took the rest but the far draft's exploration leg (every 4 legs while it is new).
        rounds = {name: service.engine._metrics.num_drafts._value.get() for name, service in
                  (("far", far), ("near", near))}
        assert rounds["near"] > rounds["far"] > 0, rounds
    finally:
        await gateway.stop()
        await far.stop(0)
        await near.stop(0)
        await proxy.stop()
        await served.stop(0)
