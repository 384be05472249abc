"""A request's ``n`` choices through the gateway (gateway.choices): each a generation of its own,
whole and streamed, chat and completions; seeds per choice; all admitted or none. Against the fake
target and draft."""

from __future__ import annotations

import json

import pytest

from gateway.choices import choice_requests, combined_usage
from gateway.events import SpeculationStats, Usage
from gateway.policy import Mode
from gateway.request import GenerationRequest, SamplingParams, Speculation
from gateway_fakes import SCRIPT_TEXT, fake_stack
from test_gateway_http import model_name, post, sse_data

MESSAGES = [{"role": "user", "content": "Say hello."}]


async def test_completions_get_n_choices_and_one_usage(stack):
    body = {"model": model_name(stack), "prompt": "Once upon", "max_tokens": 12, "n": 3, "ignore_eos": True}
    response = await post(stack, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) == 1  # the fake target continues every session alike
    usage = response.json()["usage"]
    prompt_tokens = len(stack.gateway.core.model.tokenizer("Once upon")["input_ids"])
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == 3 * 12
    assert usage["speculative_decoding"]["rounds"] > 0
    assert sum(rpc == "Prefill" for rpc, _ in stack.model.rpcs) == 3  # a target session each
    await stack.wait_until_idle()


async def test_a_chat_stream_interleaves_its_choices_and_ends_with_one_usage(stack):
    body = {"model": model_name(stack), "messages": MESSAGES, "max_tokens": 60, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    response = await post(stack, "/v1/chat/completions", body)
    events = sse_data(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * len(stack.model.expected_tokens(1000))
    texts, finishes, roles = {0: "", 1: ""}, {}, set()
    for chunk in choice_chunks:
        (choice,) = chunk["choices"]
        roles.add(choice["index"]) if choice["delta"].get("role") else None
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert roles == {0, 1} and texts == {0: SCRIPT_TEXT, 1: SCRIPT_TEXT} and finishes == {0: "stop", 1: "stop"}
    assert all(c["id"] == chunks[0]["id"] for c in chunks)
    await stack.wait_until_idle()


async def test_seeded_choices_differ_by_their_seeds(stack):
    body = {"model": model_name(stack), "prompt": "Once upon", "max_tokens": 4, "n": 3, "temperature": 0.8,
            "seed": 41, "speculation": "off"}
    response = await post(stack, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert sorted(params.sampling.seed for params in stack.model.prefilled) == [41, 42, 43]
    await stack.wait_until_idle()


async def test_choices_are_admitted_all_or_none(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), max_concurrent_requests=2) as stack:
        body = {"model": model_name(stack), "prompt": "Once upon", "max_tokens": 2, "n": 3}
        refused = await post(stack, "/v1/completions", body)
        assert refused.status_code == 429, refused.text
        assert stack.gateway.core.admission.in_flight == 0  # the two admitted first were let go
        ok = await post(stack, "/v1/completions", {**body, "n": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        await stack.wait_until_idle()


def test_each_choice_gets_its_seed_and_the_usage_counts_the_prompt_once():
    request = GenerationRequest((1, 2, 3), 8, SamplingParams(0.7, 1.0, 0, 2**64 - 1), (), (), False,
                                Speculation.AUTO, None)
    assert [r.sampling.seed for r in choice_requests(request, 3)] == [2**64 - 1, 0, 1]
    unseeded = GenerationRequest((1,), 8, SamplingParams(0.7, 1.0, 0, None), (), (), False, Speculation.AUTO, None)
    assert all(r.sampling.seed is None for r in choice_requests(unseeded, 2))
    a = Usage(3, 5, SpeculationStats(rounds=2, draft_tokens=8, accepted_tokens=3, modes_used={Mode.SPECULATIVE}), 2)
    b = Usage(3, 7, SpeculationStats(fallbacks=1, fallback_reason="low_acceptance", modes_used={Mode.AUTOREGRESSIVE}), 2)
    both = combined_usage([a, b])
    assert (both.prompt_tokens, both.completion_tokens, both.cached_prompt_tokens) == (3, 12, 2)
    s = both.speculative_decoding
    assert (s.rounds, s.draft_tokens, s.accepted_tokens, s.fallbacks, s.mode) == (2, 8, 3, 1, "mixed")
    assert s.fallback_reason == "low_acceptance"


async def test_the_openai_sdk_reads_n_choices(stack):
    import openai

    async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0) as sdk:
        response = await sdk.chat.completions.create(model=model_name(stack), messages=MESSAGES, max_tokens=5, n=2)
        streamed = await sdk.completions.create(model=model_name(stack), prompt="Go", max_tokens=5, n=2, stream=True)
        indexes = {c.choices[0].index async for c in streamed if c.choices}
    assert [c.index for c in response.choices] == [0, 1] and indexes == {0, 1}
    await stack.wait_until_idle()


# --------------------------------------------------------------------------- a batch of prompts (completions)


async def test_a_batch_of_prompts_is_answered_prompt_after_prompt_with_their_n_choices(stack):
    """OpenAI's batch: each prompt a request of its own, choice i * n + j its choice j; the usage
    counts each prompt once; echo repeats each choice's own prompt."""
    import openai

    prompts = ["Once upon", "The weather today is"]
    tokenizer = stack.gateway.core.model.tokenizer
    async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0) as sdk:
        answer = await sdk.completions.create(model=model_name(stack), prompt=prompts, n=2, max_tokens=4,
                                              echo=True, extra_body={"ignore_eos": True})
        assert [c.index for c in answer.choices] == [0, 1, 2, 3]
        assert [c.text.startswith(prompts[c.index // 2]) for c in answer.choices] == [True] * 4
        prompt_ids = [tuple(tokenizer(p)["input_ids"]) for p in prompts]
        assert answer.usage.prompt_tokens == sum(map(len, prompt_ids)) and answer.usage.completion_tokens == 4 * 4
        assert sorted(stack.model.prefilled_prompts[-4:]) == sorted(2 * prompt_ids)

        streamed = await sdk.completions.create(model=model_name(stack), prompt=[[5, 6, 7], [8, 9]], max_tokens=3,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        chunks = [chunk async for chunk in streamed]
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert chunks[-1].usage.prompt_tokens == 5 and chunks[-1].usage.completion_tokens == 6
    await stack.wait_until_idle()


async def test_a_batch_is_refused_whole_where_a_prompt_is_bad_or_it_asks_for_too_many(stack):
    body = {"model": model_name(stack), "max_tokens": 2}
    empty = await post(stack, "/v1/completions", {**body, "prompt": ["fine", ""]})
    assert empty.status_code == 400 and empty.json()["error"]["message"].startswith("prompt[1]: ")
    too_many = await post(stack, "/v1/completions", {**body, "prompt": ["a", "b", "c"], "n": 6})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt", too_many.text
    assert "18 choices" in too_many.json()["error"]["message"]
    huge = await post(stack, "/v1/completions", {**body, "prompt": ["x"] * 2048})
    assert huge.status_code == 400 and "a batch of 2048 prompts" in huge.json()["error"]["message"]
    assert not any(rpc == "Prefill" for rpc, _ in stack.model.rpcs)
    assert stack.gateway.core.admission.in_flight == 0


def test_a_batchs_usage_counts_each_prompt_once():
    usages = [Usage(p, c, SpeculationStats(), cached) for p, c, cached in ((3, 5, 1), (3, 4, 1), (7, 2, 0), (7, 1, 0))]
    both = combined_usage(usages, per_prompt=2)
    assert (both.prompt_tokens, both.completion_tokens, both.cached_prompt_tokens) == (10, 12, 1)
