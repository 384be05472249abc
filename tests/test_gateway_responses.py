"""The Responses API (``/v1/responses``) against the scripted target: the OpenAI SDK reads its
objects and events, input items become the conversation, and what tandem does not do is refused."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway_fakes import SCRIPT_TEXT, fake_stack
from gateway.chat_template import ChatMessage, ToolCallMade
from gateway.errors import InvalidRequest
from gateway.responses_api import ResponsesRequest

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
async def stack(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), max_context_len=4096) as running:
        yield running


def test_input_items_become_the_conversation() -> None:
    body = ResponsesRequest.model_validate({
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": "Weather in Oslo and Rome?"},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
                  {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "3 C"},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And?"}]}],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 9})
    fields = body.to_fields()
    assert fields.messages == [
        ChatMessage("system", "Be brief."), ChatMessage("user", "Weather in Oslo and Rome?"),
        ChatMessage("assistant", "", (ToolCallMade("c1", "get_weather", {"city": "Oslo"}),
                                      ToolCallMade("c2", "get_weather", {"city": "Rome"}))),
        ChatMessage("tool", "3 C", tool_call_id="c1"), ChatMessage("user", "And?")]
    assert fields.tool_calling.forced == "get_weather" and fields.max_tokens == 9
    schema = ResponsesRequest.model_validate({"input": "x", "text": {"format": {
        "type": "json_schema", "name": "p", "schema": {"type": "object"}}}}).to_fields().grammar
    assert json.loads(schema.spec) == {"type": "object"}
    for bad, param in (({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                       ({"input": "x", "background": True}, "background"),
                       ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
                       ({"input": "x", "tools": [WEATHER], "tool_choice": "required",
                         "text": {"format": {"type": "json_object"}}}, "text.format"),
                       ({"input": [{"type": "function_call", "call_id": "c"}]}, "input[0]"),
                       ({"input": [{"content": "no role"}]}, "input[0].role")):
        with pytest.raises(InvalidRequest) as refused:
            ResponsesRequest.model_validate(bad).to_fields()
        assert refused.value.param == param, bad


async def test_the_sdk_reads_a_response_whole_and_streamed(stack) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    model = stack.gateway.core.model.name
    whole = await sdk.responses.create(model=model, input="Say hi", max_output_tokens=5)
    assert whole.id.startswith("resp_") and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens" and whole.output_text
    assert SCRIPT_TEXT.startswith(whole.output_text) and whole.usage.output_tokens == 5
    assert whole.usage.input_tokens == len(stack.model.prefilled_prompts[-1])
    events = [e async for e in await sdk.responses.create(model=model, input="Say hi", max_output_tokens=5,
                                                          stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    await stack.wait_until_idle()


async def test_a_named_call_comes_back_as_a_function_call_item(stack) -> None:
    """The scripted text follows no grammar; a named call takes it as its arguments, whatever they are."""
    sdk = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    model = stack.gateway.core.model.name
    done = await sdk.responses.create(model=model, input="Weather in Oslo?", tools=[WEATHER],
                                      tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=4)
    call = done.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(stack.model.prefilled[-1].grammar.spec) == WEATHER["parameters"]
    events = [e async for e in await sdk.responses.create(
        model=model, input="Weather in Oslo?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=4, stream=True)]
    assert [e.type for e in events][2:5] == ["response.output_item.added", "response.function_call_arguments.done",
                                             "response.output_item.done"]
    assert events[3].arguments == call.arguments
    async with httpx.AsyncClient(base_url=stack.base_url) as client:
        refused = await client.post("/v1/responses", json={"input": "x", "previous_response_id": "r"})
        missing = await client.get(f"/v1/responses/{done.id}")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
    assert missing.status_code == 404 and "stores no responses" in missing.json()["error"]["message"]
    await stack.wait_until_idle()


async def test_log_probabilities_when_included(stack) -> None:
    """With "message.output_text.logprobs" in include: one entry per output token on the text part,
    and the same entries spread over the stream's deltas."""
    sdk = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    ask = {"model": stack.gateway.core.model.name, "input": "Say hi", "max_output_tokens": 5,
           "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = await sdk.responses.create(**ask)
    part = whole.output[0].content[0]
    assert len(part.logprobs) == whole.usage.output_tokens == 5
    assert all(len(token.top_logprobs) == 2 and token.logprob <= 0 for token in part.logprobs)
    assert stack.model.prefilled[-1].top_logprobs == 2
    events = [e async for e in await sdk.responses.create(**ask, stream=True)]
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    assert not (await sdk.responses.create(**{**ask, "include": []})).output[0].content[0].logprobs
    await stack.wait_until_idle()
