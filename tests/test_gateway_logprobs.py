"""Log-probabilities through the gateway: asked for in OpenAI's shapes (chat ``logprobs`` /
``top_logprobs``, completions ``logprobs``), whole and streamed, speculative and autoregressive,
and over gRPC; against the fake target and draft, whose made-up values say which token they
belong to (``gateway_fakes.ScriptedModel.logprobs``)."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from gateway.token_strings import TokenStrings
from gateway_fakes import SCRIPT_TEXT, prompt_value
from tandem.v1 import gateway_pb2, gateway_pb2_grpc
from test_gateway_http import model_name, post, sse_data

MESSAGES = [{"role": "user", "content": "Say hello."}]


def made_up(position: int) -> float:
    return -0.25 * (position % 4)


async def completion(stack, body: dict) -> tuple[str, dict]:
    """A completion's text and logprobs, streamed chunks joined (``body["stream"]``)."""
    response = await post(stack, "/v1/completions", body)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        choice = response.json()["choices"][0]
        return choice["text"], choice["logprobs"]
    chunks = [json.loads(data)["choices"][0] for data in sse_data(response.text)[:-1]]
    parts = [c["logprobs"] for c in chunks if c["logprobs"]]
    return "".join(c["text"] for c in chunks), {key: [v for part in parts for v in part[key]] for key in parts[0]}


@pytest.mark.parametrize("speculation", ["on", "off"])
async def test_chat_gets_each_tokens_logprob_text_and_bytes(stack, tokenizer, speculation):
    body = {"model": model_name(stack), "messages": MESSAGES, "max_tokens": 20, "logprobs": True,
            "top_logprobs": 2, "speculation": speculation}
    response = await post(stack, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == response.json()["usage"]["completion_tokens"] == 20
    # The tokens' bytes spell the answer exactly, multi-byte characters split across tokens included
    # (the last token ends inside one: a length cut shows no part of it).
    spelled = b"".join(bytes(entry["bytes"]) for entry in content)
    assert spelled.decode(errors="ignore") == choice["message"]["content"].rstrip("\ufffd")
    assert spelled.startswith(choice["message"]["content"].rstrip("\ufffd").encode())
    assert SCRIPT_TEXT.startswith(spelled.decode(errors="ignore"))
    script = stack.model.script
    for position, entry in enumerate(content):
        assert entry["logprob"] == made_up(position)
        assert [top["logprob"] for top in entry["top_logprobs"]] == [made_up(position), made_up(position) - 1]
        assert entry["top_logprobs"][0]["token"] == entry["token"] == tokenizer.decode([script[position]])
    await stack.wait_until_idle()


async def test_a_chat_stream_carries_each_tokens_logprobs_once(stack):
    body = {"model": model_name(stack), "messages": MESSAGES, "max_tokens": 24, "logprobs": True, "stream": True,
            "speculation": "on", "stream_options": {"include_usage": True}}
    response = await post(stack, "/v1/chat/completions", body)
    chunks = [json.loads(data) for data in sse_data(response.text)[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    entries = [e for choice in choices if choice["logprobs"] for e in choice["logprobs"]["content"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(entries) == chunks[-1]["usage"]["completion_tokens"] == 24
    assert [e["logprob"] for e in entries] == [made_up(i) for i in range(24)]
    assert all(e["top_logprobs"] == [] for e in entries)  # logprobs: true alone gives no alternatives
    assert b"".join(bytes(e["bytes"]) for e in entries).decode(errors="ignore") == text.rstrip("\ufffd")
    await stack.wait_until_idle()


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_get_the_legacy_shape_with_text_offsets(stack, tokenizer, stream):
    body = {"model": model_name(stack), "prompt": "Go", "max_tokens": 16, "logprobs": 1, "ignore_eos": True,
            "stream": stream}
    text, logprobs = await completion(stack, body)
    assert logprobs["token_logprobs"] == [made_up(i) for i in range(16)]
    assert [list(top.values()) for top in logprobs["top_logprobs"]] == [[made_up(i)] for i in range(16)]
    # Each token starts where the text stood when it came: where its text is whole, that is its text.
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    whole = [(o, t) for o, t in zip(offsets, logprobs["tokens"]) if "\ufffd" not in t]
    assert len(whole) > 8 and all(text[o : o + len(t)] == t for o, t in whole)
    assert logprobs["text_offset"][0] == 0
    await stack.wait_until_idle()


async def test_requests_without_them_get_null_and_the_sdk_reads_them(stack):
    plain = await post(stack, "/v1/chat/completions", {"model": model_name(stack), "messages": MESSAGES,
                                                      "max_tokens": 4})
    assert plain.json()["choices"][0]["logprobs"] is None
    async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0) as sdk:
        response = await sdk.chat.completions.create(model=model_name(stack), messages=MESSAGES, max_tokens=6,
                                                     logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 6 and all(len(entry.top_logprobs) == 3 for entry in content)
    await stack.wait_until_idle()


async def test_the_gateways_grpc_api_sends_them_with_the_tokens(stack):
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        client = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GatewayServiceGenerateRequest(prompt="Go", max_tokens=10, ignore_eos=True,
                                                            top_logprobs=1)
        responses = [r async for r in client.Generate(request)]
        bad = gateway_pb2.GatewayServiceGenerateRequest(prompt="Go", max_tokens=2, top_logprobs=50)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [r async for r in client.Generate(bad)]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in refused.value.details()
    token_ids = [t for r in responses for t in r.token_ids]
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert len(token_ids) == len(logprobs) == 10
    assert [lp.logprob for lp in logprobs] == [made_up(i) for i in range(10)]
    assert [list(lp.top_token_ids) for lp in logprobs] == [[t] for t in token_ids]
    await stack.wait_until_idle()


def test_token_strings_give_exact_bytes_for_pieces_of_a_character(tokenizer):
    strings = TokenStrings(tokenizer)
    ids = tokenizer("✓ 日本語 🙂", add_special_tokens=False)["input_ids"]
    assert b"".join(bytes(strings.of(i)[1]) for i in ids).decode() == "✓ 日本語 🙂"
    assert any("\ufffd" in strings.of(i)[0] for i in ids)  # some token holds part of a character


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_repeats_the_prompt_with_its_tokens_logprobs_as_lm_eval_asks(stack, tokenizer, stream):
    """lm-evaluation-harness's loglikelihood request: token ids, ``echo``, ``logprobs: 1``, one token.
    The prompt's first token has null value and alternatives; every later one the target's score."""
    prompt = tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    body = {"model": model_name(stack), "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "echo": True, "seed": 1234, "stream": stream}
    text, logprobs = await completion(stack, body)
    assert text == "The quick brown fox" + tokenizer.decode(stack.model.expected_tokens(1))
    values = logprobs["token_logprobs"]
    assert len(values) == len(prompt) + 1 and values[0] is None and logprobs["top_logprobs"][0] is None
    assert values[1 : len(prompt)] == [prompt_value(i) for i in range(1, len(prompt))]
    assert values[-1] == made_up(0)  # the generated token's
    # What lm-eval reads: each prompt token's value against its top alternative (here, itself).
    assert all(v == max(top.values()) for v, top in zip(values[1:], logprobs["top_logprobs"][1:]))
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[len(prompt)] == len("The quick brown fox")
    plain = await post(stack, "/v1/completions", {**body, "stream": False, "logprobs": None})
    assert plain.json()["choices"][0]["text"] == text and plain.json()["choices"][0]["logprobs"] is None
    await stack.wait_until_idle()
