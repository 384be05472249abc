"""The OpenAI-compatible HTTP API against fake target and draft services (real gRPC, port 0)."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import openai
import pytest

from gateway.chat_template import ChatFormat, ChatMessage
from gateway_fakes import SCRIPT_TEXT, fake_stack, speculations_cancelled

from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

CONTRACT_METRICS = [
    "tandem_spec_decode_num_drafts_total", "tandem_spec_decode_num_draft_tokens_total",
    "tandem_spec_decode_num_accepted_tokens_total", "tandem_spec_decode_num_accepted_tokens_per_pos_total",
    "tandem_spec_decode_acceptance_rate", "tandem_verify_duration_seconds",
    "tandem_time_to_first_token_seconds", "tandem_inter_token_latency_seconds",
    "tandem_e2e_request_latency_seconds", "tandem_session_fallbacks_total", "tandem_sessions_active",
    "tandem_requests_total",
]
# The usage fields the README documents (the design names the first six).
SPEC_KEYS = {"rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "mode", "fallbacks", "fallback_reason",
             "empty_rounds"}


@pytest.fixture
async def sdk(stack):
    """The OpenAI SDK's async client, pointed at the in-process gateway."""
    async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def model_name(stack) -> str:
    return stack.gateway.core.model.name


def sse_data(body: str) -> list[str]:
    """The payloads of an SSE body, checking the framing: every event is one `data:` line + blank line."""
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


async def post(stack, path, body=None, raw=None, timeout=10.0):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=timeout) as client:
        if raw is not None:
            return await client.post(path, content=raw, headers={"content-type": "application/json"})
        return await client.post(path, json=body)


async def test_models_health_and_metrics(stack, sdk):
    async with httpx.AsyncClient(base_url=stack.base_url) as client:
        models = (await client.get("/v1/models")).json()
        health = await client.get("/health")
        metrics = (await client.get("/metrics")).text
    assert [m["id"] for m in models["data"]] == [model_name(stack)]
    assert models["data"][0]["max_model_len"] == 128  # adopted from the target's Info
    assert health.status_code == 200
    assert health.json()["target"]["serving"] and health.json()["draft"]["serving"]
    assert [m for m in CONTRACT_METRICS if m not in metrics] == []
    assert (await sdk.models.list()).data[0].id == model_name(stack)
    assert (await sdk.models.retrieve(model_name(stack))).id == model_name(stack)
    with pytest.raises(openai.NotFoundError):
        await sdk.models.retrieve("no-such-model")
    # What placement goes by: each draft's measured committed tokens per second, by target.
    (draft,) = health.json()["draft"]["members"]
    assert draft["tokens_per_s"] == {}
    await post(stack, "/v1/completions", {"prompt": "Go", "max_tokens": 12, "ignore_eos": True, "speculation": "on"})
    async with httpx.AsyncClient(base_url=stack.base_url) as client:
        (draft,) = (await client.get("/health")).json()["draft"]["members"]
    assert list(draft["tokens_per_s"]) == [stack.gateway.core.deps.targets.spec] and all(
        rate > 0 for rate in draft["tokens_per_s"].values())


async def test_chat_completion_with_the_openai_sdk(stack, tokenizer, sdk):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    response = await sdk.chat.completions.create(
        model=model_name(stack), messages=messages, max_tokens=60, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == SCRIPT_TEXT
    assert choice.finish_reason == "stop"
    usage = response.usage
    expected_prompt = ChatFormat.for_tokenizer(tokenizer).token_ids([ChatMessage(**m) for m in messages])
    assert usage.prompt_tokens == len(expected_prompt)
    assert list(stack.model.speculate_requests[0].token_ids[: len(expected_prompt)]) == expected_prompt
    assert usage.completion_tokens == len(stack.model.expected_tokens(1000))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    spec = usage.speculative_decoding
    assert SPEC_KEYS <= set(spec) and spec["mode"] == "speculative" and spec["rounds"] > 0
    await stack.wait_until_idle()


async def test_the_targets_cached_prompt_tokens_show_in_the_usage(stack, sdk):
    """OpenAI's prompt_tokens_details.cached_tokens: what the target did not prefill (its prefix cache)."""
    stack.model.cached_tokens = 5
    for stream in (False, True):
        response = await sdk.completions.create(model=model_name(stack), prompt="Once upon a time", max_tokens=4,
                                                stream=stream, stream_options={"include_usage": True} if stream else None)
        usage = [c.usage async for c in response if c.usage][-1] if stream else response.usage
        assert usage.prompt_tokens_details.cached_tokens == 5
    await stack.wait_until_idle()


async def test_chat_stream_with_usage_chunk_and_done_last(stack, sdk):
    stream = await sdk.chat.completions.create(
        model=model_name(stack), messages=[{"role": "user", "content": "Hi"}], max_tokens=60,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == SCRIPT_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert SPEC_KEYS <= set(chunks[-1].usage.speculative_decoding)
    # The raw framing: [DONE] last, after the usage chunk.
    response = await post(stack, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 3,
        "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_data(response.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"] == [] and json.loads(events[-2])["usage"]["completion_tokens"] == 3
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
    await stack.wait_until_idle()


async def test_text_completions_stream_and_not(stack, tokenizer, sdk):
    whole = await sdk.completions.create(model=model_name(stack), prompt="Once", max_tokens=7, temperature=0)
    assert whole.choices[0].text == tokenizer.decode(stack.model.expected_tokens(7))
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 7
    assert whole.usage.speculative_decoding["mode"] == "speculative"
    stream = await sdk.completions.create(
        model=model_name(stack), prompt=[5, 6, 7], max_tokens=7, temperature=0, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert list(stack.model.speculate_requests[-1].token_ids[:3]) == [5, 6, 7]
    await stack.wait_until_idle()


async def test_speculation_off_uses_target_generate(stack, sdk):
    response = await sdk.completions.create(
        model=model_name(stack), prompt="Once", max_tokens=50, extra_body={"speculation": "off"}
    )
    assert response.choices[0].text == SCRIPT_TEXT
    spec = response.usage.speculative_decoding
    # The client's choice, not a fallback of the server's: the reason says so, the count does not.
    assert (spec["mode"], spec["rounds"], spec["fallbacks"]) == ("autoregressive", 0, 0)
    assert spec["fallback_reason"] == "speculation_off"
    assert stack.metric("tandem_session_fallbacks_total", reason="speculation_off") == 1
    assert [name for name, _ in stack.model.rpcs] == ["Prefill", "Generate", "Release"]


async def test_stop_strings_and_extension_fields(stack, sdk):
    response = await sdk.chat.completions.create(
        model=model_name(stack), messages=[{"role": "user", "content": "Hi"}], stop=["日本"],
        # "on": a seeded sampled request would otherwise decode autoregressively (reason "seeded").
        extra_body={"num_speculative_tokens": 6, "top_k": 5, "ignore_eos": True, "speculation": "on", "min_p": 0.05},
        seed=7,
    )
    assert response.choices[0].message.content == "Hello wörld ✓ "
    assert response.choices[0].finish_reason == "stop"
    request = stack.model.speculate_requests[-1]
    assert request.num_speculative_tokens == 6
    assert (request.params.sampling.top_k, request.params.sampling.seed, request.params.ignore_eos) == (5, 7, True)
    assert request.params.sampling.min_p == pytest.approx(0.05)  # float32 on the wire
    assert request.params.max_new_tokens == 32  # the gateway's default_max_tokens for chat
    await stack.wait_until_idle()



async def test_stop_token_ids_end_the_answer_without_their_text_unless_asked(stack, tokenizer):
    """vLLM's stop_token_ids reach the target's session (merged with the chat format's own), end the
    answer with "stop" and count as generated; the stop token's text is returned only with
    include_stop_str_in_output, which also returns a matched stop string."""
    script = stack.model.script
    k = next(i for i in range(3, len(script)) if script[i] not in script[:i])
    stop_id = script[k]
    for mode in ("on", "off"):
        for include in (False, True):
            body = {"prompt": "hi", "max_tokens": 30, "stop_token_ids": [stop_id], "speculation": mode,
                    "include_stop_str_in_output": include}
            answer = (await post(stack, "/v1/completions", body)).json()
            assert list(stack.model.prefilled[-1].stop_token_ids) == [stop_id]
            assert answer["choices"][0]["finish_reason"] == "stop", answer
            assert answer["usage"]["completion_tokens"] == k + 1
            assert answer["choices"][0]["text"] == tokenizer.decode(script[: k + 1 if include else k])
    stop = tokenizer.decode(script[2:4])
    answer = (await post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 30, "stop": [stop],
                                                    "include_stop_str_in_output": True})).json()
    assert answer["choices"][0]["text"] == SCRIPT_TEXT[: SCRIPT_TEXT.index(stop) + len(stop)]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stop_token_ids": [9, 7, 9]}
    assert (await post(stack, "/v1/chat/completions", chat)).status_code == 200
    assert list(stack.model.prefilled[-1].stop_token_ids)[:2] == [9, 7]
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GatewayServiceGenerateRequest(prompt="hi", max_tokens=30, stop_token_ids=[stop_id])
        chunks = [c async for c in stub.Generate(request)]
        assert "".join(c.text for c in chunks) == tokenizer.decode(script[:k])
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            bad = gateway_pb2.GatewayServiceGenerateRequest(prompt="hi", stop_token_ids=[10**9])
            [c async for c in stub.Generate(bad)]
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in refused.value.details()
    await stack.wait_until_idle()



async def test_min_tokens_reaches_the_target_and_stop_strings_wait_for_it(stack, tokenizer):
    """vLLM's min_tokens goes to the target's session (which masks its stops); stop strings are
    looked for only in the text after the first min_tokens tokens, speculating or not."""
    script = stack.model.script
    m = next(i for i in range(1, len(script)) if "Hello" in tokenizer.decode(script[:i]))
    after = len(tokenizer.decode(script[:m]))
    for mode in ("on", "off"):
        body = {"prompt": "hi", "max_tokens": 40, "stop": ["o"], "min_tokens": m, "speculation": mode}
        answer = (await post(stack, "/v1/completions", body)).json()
        assert stack.model.prefilled[-1].min_tokens == m
        assert answer["choices"][0]["text"] == SCRIPT_TEXT[: SCRIPT_TEXT.index("o", after)], answer
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        request = gateway_pb2.GatewayServiceGenerateRequest(prompt="hi", max_tokens=8, min_tokens=3)
        [c async for c in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request)]
    assert stack.model.prefilled[-1].min_tokens == 3
    await stack.wait_until_idle()



async def test_truncate_prompt_tokens_prefills_the_prompts_last_tokens(stack, tokenizer):
    """vLLM's truncate_prompt_tokens: the last N tokens of the prompt as tokenized (after the chat
    template), counted so in the usage; a prompt longer than the context fits once cut."""
    ids = tokenizer("one two three four five six seven", add_special_tokens=False)["input_ids"]
    answer = (await post(stack, "/v1/completions", {"prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 3}))
    assert list(stack.model.prefilled_prompts[-1]) == ids[-3:] and answer.json()["usage"]["prompt_tokens"] == 3
    chat = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2}
    whole = list((await post(stack, "/tokenize", chat)).json()["tokens"])
    assert (await post(stack, "/v1/chat/completions", {**chat, "truncate_prompt_tokens": 4})).status_code == 200
    assert list(stack.model.prefilled_prompts[-1]) == whole[-4:]
    long = {"prompt": [5] * 200, "max_tokens": 2}
    assert (await post(stack, "/v1/completions", long)).status_code == 400  # the context is 128
    assert (await post(stack, "/v1/completions", {**long, "truncate_prompt_tokens": 100})).status_code == 200
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        request = gateway_pb2.GatewayServiceGenerateRequest(prompt_token_ids=ids, max_tokens=2,
                                                            truncate_prompt_tokens=2)
        [c async for c in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request)]
    assert list(stack.model.prefilled_prompts[-1]) == ids[-2:]
    await stack.wait_until_idle()


# Each case: (name, body or raw bytes, param expected in the error or None)
BAD_HTTP = [
    ("malformed JSON", b"{not json", None),
    ("body not an object", b"[1, 2]", None),
    ("missing prompt", {"max_tokens": 4}, "prompt"),
    ("wrong type: max_tokens string", {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ("wrong type: stream int", {"prompt": "hi", "stream": 1}, "stream"),
    ("wrong type: prompt number", {"prompt": 5}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("empty token prompt", {"prompt": []}, "prompt"),
    ("prompt longer than the context", {"prompt": [5] * 128}, "prompt"),
    ("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens absurd", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("temperature -1", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("temperature NaN", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("temperature 3", {"prompt": "hi", "temperature": 3}, "temperature"),
    ("top_p 0", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("top_p 2", {"prompt": "hi", "top_p": 2}, "top_p"),
    ("n 0", {"prompt": "hi", "n": 0}, "n"),
    ("n 17", {"prompt": "hi", "n": 17}, "n"),
    ("unknown model", {"prompt": "hi", "model": "no-such-model"}, "model"),
    ("out-of-vocabulary token", {"prompt": [1, 2, 100000]}, "prompt"),
    ("speculation invalid", {"prompt": "hi", "speculation": "sometimes"}, "speculation"),
    ("speculation wrong type", {"prompt": "hi", "speculation": True}, "speculation"),
    ("num_speculative_tokens 0", {"prompt": "hi", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ("num_speculative_tokens 65", {"prompt": "hi", "num_speculative_tokens": 65}, "num_speculative_tokens"),
    ("top_k -1", {"prompt": "hi", "top_k": -1}, "top_k"),
    ("ignore_eos not a bool", {"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
    ("logprobs 21", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("logprobs -1", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("logit_bias key not a token id", {"prompt": "hi", "logit_bias": {"hello": 10}}, "logit_bias"),
    ("logit_bias negative key", {"prompt": "hi", "logit_bias": {"-5": 10}}, "logit_bias"),
    ("logit_bias huge key", {"prompt": "hi", "logit_bias": {"9" * 5000: 10}}, "logit_bias"),
    ("logit_bias outside the vocabulary", {"prompt": "hi", "logit_bias": {"1000000000": 1}}, "logit_bias"),
    ("logit_bias 101", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("logit_bias value a string", {"prompt": "hi", "logit_bias": {"5": "1"}}, "logit_bias"),
    ("presence_penalty 2.5", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty -3", {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ("logit_bias wrong type", {"prompt": "hi", "logit_bias": [5]}, "logit_bias"),
    ("stop_token_ids outside the vocabulary", {"prompt": "hi", "stop_token_ids": [1000000000]}, "stop_token_ids"),
    ("stop_token_ids negative", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("stop_token_ids too many", {"prompt": "hi", "stop_token_ids": list(range(65))}, "stop_token_ids"),
    ("stop_token_ids not ids", {"prompt": "hi", "stop_token_ids": ["</s>"]}, "stop_token_ids"),
    ("skip_special_tokens not a bool", {"prompt": "hi", "skip_special_tokens": "no"}, "skip_special_tokens"),
    ("include_stop_str_in_output not a bool", {"prompt": "hi", "include_stop_str_in_output": 1},
     "include_stop_str_in_output"),
    ("min_tokens past max_tokens", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("min_tokens negative", {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    ("repetition_penalty 0", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("repetition_penalty 3", {"prompt": "hi", "repetition_penalty": 3}, "repetition_penalty"),
    ("min_p above 1", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("min_p negative", {"prompt": "hi", "min_p": -0.1}, "min_p"),
    ("typical_p 0", {"prompt": "hi", "typical_p": 0}, "typical_p"),
    ("typical_p above 1", {"prompt": "hi", "typical_p": 1.2}, "typical_p"),
    ("truncate_prompt_tokens 0", {"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
]
BAD_CHAT = [
    ("missing messages", {"max_tokens": 4}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("message without role", {"messages": [{"content": "hi"}]}, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("max_completion_tokens 0", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_tokens"),
    ("response_format unknown", {"messages": [{"role": "user", "content": "hi"}],
                                 "response_format": {"type": "yaml"}}, "response_format"),
    ("json_schema without its object", {"messages": [{"role": "user", "content": "hi"}],
                                        "response_format": {"type": "json_schema"}}, "response_format"),
    ("json_schema schema not an object", {"messages": [{"role": "user", "content": "hi"}],
                                          "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format"),
    ("regex without its string", {"messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "regex"}}, "response_format"),
    ("structured output with ignore_eos", {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
                                           "response_format": {"type": "json_object"}}, "ignore_eos"),
    ("structured output with min_tokens", {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 2,
                                           "response_format": {"type": "json_object"}}, "min_tokens"),
    ("regex too long to compile", {"messages": [{"role": "user", "content": "hi"}],
                                   "response_format": {"type": "regex", "regex": "a" * 70000}}, "response_format"),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
    ("top_logprobs 21", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("prediction of another type", {"messages": [{"role": "user", "content": "hi"}],
                                    "prediction": {"type": "file", "content": "x"}}, "prediction"),
    ("tool_choice unknown", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "maybe",
                             "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("tool_choice names no tool", {"messages": [{"role": "user", "content": "hi"}],
                                   "tools": [{"type": "function", "function": {"name": "f"}}],
                                   "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("tools with response_format", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                                    "tools": [{"type": "function", "function": {"name": "f"}}],
                                    "response_format": {"type": "json_object"}}, "response_format"),
    ("tool parameters not a schema", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                                      "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                          "type": "whatever"}}}]}, "tools[0].function.parameters"),
    ("tool call arguments not JSON", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f",
                                                                                           "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0]"),
]


def _cases():
    for name, body, param in BAD_HTTP:
        yield f"completions: {name}", "/v1/completions", body, param
    for name, body, param in BAD_CHAT:
        yield f"chat: {name}", "/v1/chat/completions", body, param


async def test_bad_input_table_gets_4xx_openai_errors_and_service_goes_on(stack):
    for name, path, body, param in _cases():
        if isinstance(body, bytes):
            response = await post(stack, path, raw=body)
        else:
            response = await post(stack, path, {"model": model_name(stack), **body})
        want = 404 if name.endswith("unknown model") else 400  # as OpenAI: an unknown model is not found
        assert response.status_code == want, (name, response.text)
        assert response.headers["content-type"] == "application/json", name
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], name
        assert error["param"] == param, (name, error)
        ok = await post(stack, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200, (name, ok.text)
    assert stack.metric("tandem_requests_total", status="invalid") == len(BAD_HTTP) + len(BAD_CHAT)
    await stack.wait_until_idle()


async def test_neutral_values_of_unsupported_features_are_accepted(stack):
    """Frontends that always send a plain-text response_format, tools with tool_choice "none" or an
    empty logit_bias get an ordinary answer."""
    body = {"model": model_name(stack), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "text"}, "logit_bias": {},
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}
    response = await post(stack, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    await stack.wait_until_idle()


async def test_skip_special_tokens_false_shows_special_tokens_but_not_the_one_that_ended_the_answer(stack, tokenizer):
    """vLLM's skip_special_tokens: false keeps special tokens' text; the token that ended the answer
    (here the model's end-of-sequence token) shows only with include_stop_str_in_output."""
    eos = tokenizer.decode([tokenizer.eos_token_id])
    assert eos and tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=True) == ""
    for mode in ("on", "off"):
        for skip, include, shown in ((True, True, ""), (False, False, ""), (False, True, eos)):
            body = {"prompt": "hi", "max_tokens": 100, "speculation": mode, "skip_special_tokens": skip,
                    "include_stop_str_in_output": include}
            answer = (await post(stack, "/v1/completions", body)).json()
            assert answer["choices"][0]["finish_reason"] == "stop", answer
            assert answer["choices"][0]["text"] == SCRIPT_TEXT + shown, (skip, include)
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        request = gateway_pb2.GatewayServiceGenerateRequest(prompt="hi", max_tokens=100, skip_special_tokens=False,
                                                            include_stop_str_in_output=True)
        chunks = [c async for c in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request)]
        assert "".join(c.text for c in chunks) == SCRIPT_TEXT + eos
    await stack.wait_until_idle()


async def test_penalties_min_p_and_typical_p_reach_the_target_from_http_and_grpc(stack):
    """OpenAI's presence and frequency penalties, the repetition penalty, min_p and typical_p go to the
    target's session as they were sent (HTTP), or as the gRPC request's optional fields; unset, neutral."""
    body = {"model": model_name(stack), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "presence_penalty": 0.5, "frequency_penalty": -1.25, "repetition_penalty": 1.25, "typical_p": 0.5}
    assert (await post(stack, "/v1/chat/completions", body)).status_code == 200
    params = stack.model.prefilled[-1]
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1.25, 1.25)
    assert params.sampling.typical_p == 0.5
    assert (await post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 2})).status_code == 200
    params = stack.model.prefilled[-1]
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0, 0, 1)
    assert params.sampling.min_p == 0 and params.sampling.typical_p == 1
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        request = gateway_pb2.GatewayServiceGenerateRequest(prompt="hi", max_tokens=2, frequency_penalty=0.75,
                                                            repetition_penalty=0.5, min_p=0.25, typical_p=0.75)
        [c async for c in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request)]
    params = stack.model.prefilled[-1]
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0, 0.75, 0.5)
    assert params.sampling.min_p == 0.25 and params.sampling.typical_p == 0.75
    await stack.wait_until_idle()


async def test_tokenize_gives_the_ids_a_request_prefills_and_detokenize_reverses_them(stack):
    """/tokenize answers with exactly the prompt ids a completions or chat request with the same input
    sends to the target (vLLM's request and response shapes); /detokenize gives the text back."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo, wörld"}]
    chat = await post(stack, "/tokenize", {"messages": messages, "model": model_name(stack)})
    assert chat.status_code == 200, chat.text
    await post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    prefilled = list(stack.model.prefilled_prompts[-1])
    assert chat.json()["tokens"] == prefilled and chat.json()["count"] == len(prefilled)
    assert chat.json()["max_model_len"] == 128 and chat.json()["token_strs"] is None
    text = await post(stack, "/tokenize", {"prompt": "héllo, wörld", "return_token_strs": True})
    await post(stack, "/v1/completions", {"prompt": "héllo, wörld", "max_tokens": 1})
    assert text.json()["tokens"] == list(stack.model.prefilled_prompts[-1])
    assert len(text.json()["token_strs"]) == text.json()["count"]
    bare = (await post(stack, "/tokenize", {"prompt": "héllo, wörld", "add_special_tokens": False})).json()
    tokenizer = stack.gateway.core.model.tokenizer
    assert bare["tokens"] == tokenizer("héllo, wörld", add_special_tokens=False)["input_ids"]
    open_turn = (await post(stack, "/tokenize", {"messages": messages, "add_generation_prompt": False})).json()
    assert open_turn["count"] < chat.json()["count"]
    back = await post(stack, "/detokenize", {"tokens": bare["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "héllo, wörld"}
    for path, body, param in (("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
                              ("/detokenize", {"tokens": [1, -1]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")):
        refused = await post(stack, path, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (body, refused.text)
    missing = await post(stack, "/tokenize", {"prompt": "a", "model": "gpt-4"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    await stack.wait_until_idle()


async def test_logit_bias_reaches_the_target_from_http_and_grpc(stack):
    """OpenAI's logit_bias (token ids as JSON strings) goes to the target's session as a map of ids;
    gRPC's map field likewise; unset or empty, none."""
    body = {"model": model_name(stack), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logit_bias": {"7": -100, " 3": 2.5, "11": 100}}
    assert (await post(stack, "/v1/chat/completions", body)).status_code == 200
    assert dict(stack.model.prefilled[-1].logit_bias) == {3: 2.5, 7: -100, 11: 100}
    unbiased = await post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {}})
    assert unbiased.status_code == 200
    assert not stack.model.prefilled[-1].logit_bias
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GatewayServiceGenerateRequest(prompt="hi", max_tokens=2, logit_bias={5: -1.5})
        [c async for c in stub.Generate(request)]
        assert dict(stack.model.prefilled[-1].logit_bias) == {5: -1.5}
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            bad = gateway_pb2.GatewayServiceGenerateRequest(prompt="hi", max_tokens=2, logit_bias={5: 250})
            [c async for c in stub.Generate(bad)]
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in refused.value.details()
    await stack.wait_until_idle()


async def test_sdk_raises_not_found_for_unknown_model(stack, sdk):
    with pytest.raises(openai.NotFoundError) as info:
        await sdk.completions.create(model="gpt-4", prompt="hi")
    assert info.value.body["code"] == "model_not_found"


async def test_unknown_route_is_an_openai_error(stack):
    async with httpx.AsyncClient(base_url=stack.base_url) as client:
        response = await client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["message"]


async def test_client_disconnect_mid_stream_releases_the_session(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), token_delay=0.02) as stack:
        # "on": the session speculates even if a slow health check on a busy host opened the breaker.
        body = {"prompt": "Go", "max_tokens": 100, "stream": True, "ignore_eos": True, "speculation": "on"}
        async with httpx.AsyncClient(base_url=stack.base_url) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                received = 0
                async for line in response.aiter_lines():
                    received += line.startswith("data: ")
                    if received == 3:
                        break
        assert stack.sessions_active() <= 1
        await stack.wait_until_idle()
        (session_id,) = stack.model.released
        assert await speculations_cancelled(stack.model) == [session_id]
        assert stack.metric("tandem_requests_total", status="abort") == 1
        assert len(stack.model.speculate_requests) == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_during_the_prefill_cancels_it(tokenizer, tiny_dir, stream):
    """A long prompt's prefill is seconds of target time: a client that leaves cancels it."""
    async with fake_stack(tokenizer, str(tiny_dir)) as stack:
        stack.model.prefill_delay = 30.0
        body = {"prompt": "Go", "max_tokens": 10, "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            await post(stack, "/v1/completions", body, timeout=0.3)
        for _ in range(100):
            if stack.model.cancelled_prefills:
                break
            await asyncio.sleep(0.05)
        assert len(stack.model.cancelled_prefills) == 1 and not stack.model.sessions
        stack.model.prefill_delay = 0.0
        assert (await post(stack, "/v1/completions", {"prompt": "Go", "max_tokens": 2})).status_code == 200
        await stack.wait_until_idle()


async def test_client_disconnect_during_a_non_stream_request_releases_the_session(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), token_delay=0.02) as stack:
        # "on": the session speculates even if a slow health check on a busy host opened the breaker.
        body = {"prompt": "Go", "max_tokens": 100, "ignore_eos": True, "speculation": "on"}
        request = asyncio.ensure_future(post(stack, "/v1/completions", body, timeout=30.0))
        # Leave once the session speculates (a fixed client timeout could fire before it did on a busy host).
        for _ in range(200):
            if stack.model.speculate_requests or request.done():
                break
            await asyncio.sleep(0.01)
        assert not request.done(), "the request ended before the client could leave"
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        await stack.wait_until_idle()
        assert len(stack.model.released) == 1 and await speculations_cancelled(stack.model) == stack.model.released


async def test_overload_gets_429_and_service_recovers(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), token_delay=0.02, max_concurrent_requests=1) as stack:
        body = {"prompt": "Go", "max_tokens": 20, "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=stack.base_url) as client:
            async with client.stream("POST", "/v1/completions", json=body) as first:
                lines = first.aiter_lines()
                await anext(lines)
                refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert refused.status_code == 429
                assert refused.json()["error"]["type"] == "rate_limit_error"
                rest = [line async for line in lines if line]
                assert rest[-1] == "data: [DONE]"
        await stack.wait_until_idle()
        ok = await post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
        assert stack.metric("tandem_requests_total", status="rejected") == 1


async def test_draft_down_auto_falls_back_and_on_gets_503(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), draft_up=False) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url) as client:
            health = await client.get("/health")
        assert health.status_code == 503
        assert health.json()["target"]["serving"] and not health.json()["draft"]["serving"]
        auto = await post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 50})
        assert auto.status_code == 200 and auto.json()["choices"][0]["text"] == SCRIPT_TEXT
        spec = auto.json()["usage"]["speculative_decoding"]
        assert (spec["mode"], spec["fallbacks"], spec["fallback_reason"]) == ("autoregressive", 1, "draft_unavailable")
        assert stack.metric("tandem_session_fallbacks_total", reason="draft_unavailable") == 1
        on = await post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 5, "speculation": "on"})
        assert on.status_code == 503
        assert "draft service" in on.json()["error"]["message"]
        await stack.wait_until_idle()
        assert len(stack.model.released) == 2


async def test_target_down_gets_503(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), target_address="127.0.0.1:1") as stack:
        response = await post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 503
        assert "target service at 127.0.0.1:1 is unavailable" in response.json()["error"]["message"]
        assert stack.sessions_active() == 0 and stack.gateway.core.admission.in_flight == 0


async def test_upstream_error_mid_stream_sends_an_error_event_then_done(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), draft_fails_after_rounds=1) as stack:
        response = await post(stack, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "stream": True, "speculation": "on"})
        events = sse_data(response.text)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "fake draft broke down" in error["message"]
        assert any(json.loads(e).get("choices", [{}])[0].get("delta", {}).get("content") for e in events[1:-2])
        await stack.wait_until_idle()
        ok = await post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 50, "speculation": "off"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == SCRIPT_TEXT
        assert stack.metric("tandem_requests_total", status="error") == 1


async def test_concurrent_requests_are_independent(stack, sdk):
    results = await asyncio.gather(*[
        sdk.completions.create(model=model_name(stack), prompt="Once", max_tokens=n) for n in (3, 9, 27)
    ])
    assert [r.usage.completion_tokens for r in results] == [3, 9, 27]
    await stack.wait_until_idle()
    assert len(set(stack.model.released)) == 3


async def test_stopping_the_gateway_ends_streams_cleanly_and_releases_sessions(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), token_delay=0.02) as stack:
        body = {"prompt": "Go", "max_tokens": 100, "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=stack.base_url) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                await anext(lines)
                stopping = asyncio.ensure_future(stack.gateway.stop(grace=0.1))
                rest = [line async for line in lines if line]
                await stopping
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["message"] == "the gateway is shutting down" and error["code"] == "shutting_down"
        assert len(stack.model.released) == 1 and not stack.model.sessions and stack.sessions_active() == 0


async def test_tokenizer_mismatch_is_reported_and_refused(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir)) as stack:
        stack.model.fingerprint = "0" * 32  # the target now tokenizes differently
        async with httpx.AsyncClient(base_url=stack.base_url) as client:
            health = await client.get("/health")
        assert health.status_code == 503
        detail = health.json()["target"]["detail"]
        assert "tokenizer mismatch" in detail and model_name(stack) in detail and "fake-target" in detail
        response = await post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
        assert response.status_code == 502
        assert "tokenizer fingerprint mismatch" in response.json()["error"]["message"]
