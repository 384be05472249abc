"""What tandem does not do is refused by name, never silently dropped (gateway.unsupported): other
servers' sampling controls, audio, web search, legacy functions, images in messages, built-in tools;
the same fields with their neutral values, and fields that only describe the caller, pass."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.errors import InvalidRequest
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.responses_api import ResponsesRequest
from gateway.structured_fields import FIELDS as STRUCTURED_FIELDS
from gateway.unsupported import REFUSED
from gateway_fakes import fake_stack

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}
RESPONSES = {"input": "hi"}

# field: (a value that asks for something tandem does not do, its neutral value)
ASKS_AND_NEUTRAL = {
    "functions": ([{"name": "f", "parameters": {"type": "object"}}], []),
    "function_call": ({"name": "f"}, "none"),
    "audio": ({"voice": "alloy", "format": "wav"}, None),
    "modalities": (["text", "audio"], ["text"]),
    "web_search_options": ({}, None),
    "tfs_z": (0.95, 1),
    "top_a": (0.1, 0),
    "repeat_penalty": (True, 1),  # True is not 1
    "mirostat": (2, 0),
    "mirostat_mode": (1, 0),
    "dry_multiplier": (0.8, 0.0),
    "xtc_probability": (0.5, 0),
    "use_beam_search": (True, False),
    "prompt_logprobs": (1, None),
    "return_tokens_as_token_ids": (True, False),
    "skip_special_tokens": (False, True),
    "guided_json": ({"type": "object"}, None),
    "guided_regex": ("a+", None),
    "guided_choice": (["yes", "no"], None),
    "guided_grammar": ("root ::= \"a\"", None),
    "structured_outputs": ({"json": {}}, None),
    "json_schema": ({"type": "object"}, None),
    "grammar": ("root ::= \"a\"", None),
    "chat_template": ("{{ messages }}", None),
    "continue_final_message": (True, False),
    "add_generation_prompt": (False, True),
    "chat_template_kwargs": ({"enable_thinking": False}, {}),
}
# Read on chat completions (test_gateway_chat_template.py), refused elsewhere.
CHAT_FIELDS = {"continue_final_message", "add_generation_prompt", "chat_template_kwargs"}
# Read on chat completions and completions (test_gateway_http.py), refused on responses.
TEXT_FIELDS = {"skip_special_tokens"}
# Fields that describe the caller or hint at effort: nothing a client could check changes.
IGNORED = {"user": "bob", "metadata": {"team": "a"}, "store": False, "service_tier": "auto",
           "reasoning_effort": "low", "verbosity": "low", "prompt_cache_key": "k", "safety_identifier": "s",
           "parallel_tool_calls": True}


def test_every_refused_field_is_tested() -> None:
    assert set(ASKS_AND_NEUTRAL) == set(REFUSED)


ROUTES = {"chat": (ChatCompletionRequest, CHAT), "completions": (CompletionRequest, COMPLETION),
          "responses": (ResponsesRequest, RESPONSES)}
# Other servers' structured-output fields are read on chat and completions (test_gateway_structured_fields.py).
CASES = [pytest.param(*ROUTES[route], field, id=f"{route}-{field}") for field in sorted(ASKS_AND_NEUTRAL)
         for route in ROUTES if (route == "responses" or field not in STRUCTURED_FIELDS)
         and (route != "chat" or field not in CHAT_FIELDS) and (route == "responses" or field not in TEXT_FIELDS)]


@pytest.mark.parametrize("request_type, base, field", CASES)
def test_a_field_is_refused_by_name_where_it_asks_and_passes_where_neutral(request_type, base, field) -> None:
    asks, neutral = ASKS_AND_NEUTRAL[field]
    with pytest.raises(InvalidRequest) as refused:
        request_type.model_validate({**base, field: asks}).to_fields()
    assert refused.value.param == field and field in refused.value.message
    request_type.model_validate({**base, field: neutral}).to_fields()


def test_fields_that_only_describe_the_caller_are_ignored() -> None:
    assert ChatCompletionRequest.model_validate({**CHAT, **IGNORED}).to_fields().messages[0].content == "hi"
    CompletionRequest.model_validate({**COMPLETION, **IGNORED}).to_fields()
    ResponsesRequest.model_validate({**RESPONSES, **IGNORED}).to_fields()


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_parts_and_tools_tandem_cannot_use_are_named() -> None:
    cases = [
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, IMAGE]}]},
         "messages[0].content[1]", "'image_url'"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
         "messages[0].content[0]", "'input_audio'"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text", "needs its text"),
        (ChatCompletionRequest, {**CHAT, "tools": [{"type": "web_search"}]}, "tools[0]", "'web_search'"),
        (ChatCompletionRequest, {**CHAT, "tools": [{"type": "function"}]}, "tools[0].function", "needs its function"),
        (ResponsesRequest, {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "Look:"}, {"type": "input_image", "image_url": "data:x"}]}]},
         "input[0].content[1]", "'input_image'"),
        (ResponsesRequest, {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input[0].content[0]", "'input_file'"),
        (ResponsesRequest, {**RESPONSES, "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]},
         "tools[0]", "'file_search'"),
        (ResponsesRequest, {**RESPONSES, "tools": [{"type": "function"}]}, "tools[0].name", "needs its name"),
        (ResponsesRequest, {**RESPONSES, "prompt": {"id": "pmpt_1"}}, "prompt", "stored prompt"),
    ]
    for request_type, body, param, said in cases:
        with pytest.raises(InvalidRequest) as refused:
            request_type.model_validate(body).to_fields()
        assert (refused.value.param, said in refused.value.message) == (param, True), (body, refused.value.message)
    # Text parts are read as before, and an assistant's refusal part as its text.
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}]}
    assert [m.content for m in ChatCompletionRequest.model_validate(parts).to_fields().messages] == ["ab", "I can't."]
    user_refusal = {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}
    with pytest.raises(InvalidRequest) as refused:
        ChatCompletionRequest.model_validate(user_refusal).to_fields()
    assert refused.value.param == "messages[0].content[0]"


@pytest.fixture
async def stack(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir)) as running:
        yield running


async def test_over_http_a_refusal_is_a_400_naming_the_field_and_the_service_goes_on(stack) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    model = stack.gateway.core.model.name
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.chat.completions.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}])
    assert refused.value.body["param"] == "messages[0].content[1]" and "image_url" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.chat.completions.create(model=model, max_tokens=2, messages=CHAT["messages"],
                                          modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    assert refused.value.body["param"] in ("audio", "modalities")
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"tfs_z": 0.9})
    assert refused.value.body["param"] == "tfs_z"
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
        tokenized = await client.post("/tokenize", json={"messages": [{"role": "user", "content": [IMAGE]}]})
        assert tokenized.status_code == 400 and tokenized.json()["error"]["param"] == "messages[0].content[0]"
    answer = await sdk.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"tfs_z": 1})
    assert answer.usage.completion_tokens == 2
    await stack.wait_until_idle()


async def test_a_route_this_server_lacks_is_told_which_it_has(stack) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        await sdk.embeddings.create(model=stack.gateway.core.model.name, input="hi")
    assert "POST /v1/embeddings is not served here" in missing.value.body["message"]
    assert "/v1/chat/completions" in missing.value.body["message"]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
        wrong_method = await client.get("/v1/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["message"].startswith("GET /v1/completions is not served here")
