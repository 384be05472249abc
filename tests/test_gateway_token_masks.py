"""vLLM's bad_words and allowed_token_ids at the gateway (gateway.token_masks, gateway.validation): the
token sequences a word is banned as (its spelling at the start and after a space), refusals by name,
and both reaching the target from HTTP (chat, completions, responses) and gRPC. What the target does
with them: test_target_bad_words, test_target_allowed_tokens; through the whole stack: test_stack_tiny."""

from __future__ import annotations

import re

import grpc
import httpx
import pytest

from gateway.token_masks import bad_word_sequences
from gateway.errors import InvalidRequest
from tandem.rpc.types import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from tandem.v1 import gateway_pb2, gateway_pb2_grpc


def ids(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def sent_bad_words(stack) -> list[tuple[int, ...]]:
    """The banned sequences of the last session the (fake) target prefilled."""
    return [tuple(s.token_ids) for s in stack.model.prefilled[-1].bad_words]


def test_a_word_is_banned_as_it_opens_the_text_and_as_it_follows_a_space(tokenizer) -> None:
    plain, spaced = ids(tokenizer, "and"), ids(tokenizer, " and")
    assert plain[0] != spaced[0] and len(plain) == len(spaced)  # the tiny tokenizer has a word token for " a"
    assert bad_word_sequences(["and"], tokenizer) == (plain, spaced)
    assert bad_word_sequences(["  and", "and"], tokenizer) == (plain, spaced)  # leading spaces dropped; once
    # " hello" is a space token, then "hello"'s own: the spaced spelling adds nothing (vLLM's rule).
    assert len(ids(tokenizer, " hello")) == len(ids(tokenizer, "hello")) + 1
    assert bad_word_sequences(["hello"], tokenizer) == (ids(tokenizer, "hello"),)
    assert bad_word_sequences([], tokenizer) == ()


@pytest.mark.parametrize(("words", "message"), [
    ([""], "bad_words[0] is blank"),
    (["ok", "   "], "bad_words[1] is blank"),
    (["x" * 4000], f"more than the {MAX_BAD_WORD_TOKENS}"),
    ([f"w{i}" for i in range(MAX_BAD_WORDS + 1)], f"more than the {MAX_BAD_WORDS} allowed"),
])
def test_bad_words_that_cannot_be_banned_are_refused_by_name(tokenizer, words, message) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(message)) as refused:
        bad_word_sequences(words, tokenizer)
    assert refused.value.param == "bad_words"


async def test_bad_words_reach_the_target_from_http_and_grpc_and_refusals_are_400s(stack, tokenizer) -> None:
    banned = [ids(tokenizer, "and"), ids(tokenizer, " and")]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/responses", {"input": "hi"})):
            key = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
            answer = await client.post(path, json={**body, key: 2, "bad_words": ["and"]})
            assert answer.status_code == 200, answer.text
            assert sent_bad_words(stack) == banned, path
        answer = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert sent_bad_words(stack) == []
        for body in ({"prompt": "hi", "bad_words": [" "]},
                     {"prompt": "hi", "bad_words": ["no"], "response_format": {"type": "json_object"}},
                     {"prompt": "hi", "bad_words": "and"}):
            refused = await client.post("/v1/completions", json={**body, "max_tokens": 2})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words", refused.text
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        request = gateway_pb2.GatewayServiceGenerateRequest(prompt="hi", max_tokens=2, bad_words=["and"])
        [c async for c in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request)]
        assert sent_bad_words(stack) == banned
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            blank = gateway_pb2.GatewayServiceGenerateRequest(prompt="hi", max_tokens=2, bad_words=[""])
            [c async for c in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(blank)]
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "bad_words" in refused.value.details()
    await stack.wait_until_idle()


async def test_allowed_token_ids_reach_the_target_sorted_and_bad_ones_are_400s(stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                           ("/v1/responses", {"input": "hi", "max_output_tokens": 2})):
            answer = await client.post(path, json={**body, "allowed_token_ids": [9, 5, 9]})
            assert answer.status_code == 200, answer.text
            assert list(stack.model.prefilled[-1].allowed_token_ids) == [5, 9], path
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert list(stack.model.prefilled[-1].allowed_token_ids) == []
        vocab = len(stack.gateway.core.model.tokenizer)
        for extra in ({"allowed_token_ids": []}, {"allowed_token_ids": [vocab]}, {"allowed_token_ids": [-1]},
                      {"allowed_token_ids": [5], "bad_words": ["and"]}, {"allowed_token_ids": [5], "min_tokens": 1},
                      {"allowed_token_ids": [5], "response_format": {"type": "json_object"}},
                      {"allowed_token_ids": "5"}):
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})
            assert refused.status_code == 400, (extra, refused.text)
            assert refused.json()["error"]["param"] == "allowed_token_ids", (extra, refused.text)
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        request = gateway_pb2.GatewayServiceGenerateRequest(prompt="hi", max_tokens=2, allowed_token_ids=[7, 3])
        [c async for c in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request)]
        assert list(stack.model.prefilled[-1].allowed_token_ids) == [3, 7]
    await stack.wait_until_idle()
