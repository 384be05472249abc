"""Through the real gateway (HTTP) in front of fake upstreams: up-front policies are visible in the
usage and the metrics, and the stream_smoothing override changes nothing but timing."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway_fakes import SCRIPT_TEXT, fake_stack


async def completion(stack, body: dict) -> dict:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        response = await client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 60, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def streamed(stack, body: dict) -> tuple[list[str], dict]:
    """Text chunks and the usage of a streamed completion."""
    texts, usage = [], {}
    body = {"prompt": "Once", "max_tokens": 60, "stream": True, "stream_options": {"include_usage": True}, **body}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                texts += [c["text"] for c in chunk.get("choices", []) if c.get("text")]
    return texts, usage


@pytest.mark.parametrize(
    ("body", "reason"),
    [({"temperature": 1.0}, "high_temperature"), ({"temperature": 0, "speculation": "off"}, "speculation_off"),
     ({"temperature": 0.5, "seed": 7}, "seeded")],
)
async def test_up_front_fallbacks_are_counted_with_their_reason(tokenizer, tiny_dir, body, reason):
    async with fake_stack(tokenizer, str(tiny_dir), fallback_max_temperature=0.8) as stack:
        answer = await completion(stack, body)
        assert answer["choices"][0]["text"] == SCRIPT_TEXT
        spec = answer["usage"]["speculative_decoding"]
        counted = 0 if reason == "speculation_off" else 1  # the client's own "off" is no fallback
        assert (spec["mode"], spec["fallbacks"], spec["rounds"]) == ("autoregressive", counted, 0)
        assert spec["fallback_reason"] == reason
        assert stack.metric("tandem_session_fallbacks_total", reason=reason) == 1
        assert not any(name == "Speculate" for name, _ in stack.model.rpcs)
        await stack.wait_until_idle()


async def test_saturation_sends_new_sessions_to_generate(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), fallback_max_sessions=1, token_delay=0.01) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            body = {"prompt": "Once", "max_tokens": 60, "temperature": 0, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as first:
                await anext(first.aiter_lines())  # the first session is active
                second = await completion(stack, {"temperature": 0})
        assert second["usage"]["speculative_decoding"]["mode"] == "autoregressive"
        assert stack.metric("tandem_session_fallbacks_total", reason="saturated") == 1


async def test_stream_smoothing_override_keeps_text_and_usage(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), stream_smoothing="off", token_delay=0.005) as stack:
        raw_chunks, raw_usage = await streamed(stack, {"temperature": 0})
        paced_chunks, paced_usage = await streamed(stack, {"temperature": 0, "stream_smoothing": "auto"})
    assert "".join(raw_chunks) == "".join(paced_chunks) == SCRIPT_TEXT
    assert raw_usage == paced_usage
    # Raw: one chunk per round of K // 2 + 1 tokens; paced: one chunk per printable token.
    assert len(paced_chunks) > len(raw_chunks)


async def test_a_finished_session_reports_to_the_temperature_prior(tokenizer, tiny_dir):
    """What speculation gave a session reaches gateway.prior, whose average the gateway exports."""
    async with fake_stack(tokenizer, str(tiny_dir), token_delay=0.002) as stack:
        await completion(stack, {"temperature": 0, "max_tokens": 20, "speculation": "off"})  # times a step
        assert stack.metric("tandem_speculation_prior_ratio", temperature="0", load="1") == 0  # plain decoding reports nothing
        answer = await completion(stack, {"temperature": 0, "max_tokens": 60})
        assert answer["usage"]["speculative_decoding"]["rounds"] >= 4
        await stack.wait_until_idle()
        assert stack.metric("tandem_speculation_prior_ratio", temperature="0", load="1") > 0
