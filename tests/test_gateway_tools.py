"""Tool calling's pieces without a stack: what a request may ask, the grammar its calls follow, the
conversation the model sees, and the calls read back from the text (gateway.tools,
gateway.tool_stream)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.chat_template import ChatMessage, ToolCallMade
from gateway.errors import InvalidRequest
from gateway.tool_stream import ToolCallStream
from gateway.tools import NamedToolChoice, ToolDef, rendered, tool_calling
from tandem.rpc.types import GrammarKind

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
           "required": ["city"]}
TOOLS = [ToolDef.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                                  "description": "Weather now"}}),
         ToolDef.model_validate({"type": "function", "function": {"name": "now"}})]


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_what_a_request_may_ask() -> None:
    assert tool_calling(None, None, None) is None and tool_calling(TOOLS, "none", None) is None
    required = tool_calling(TOOLS, "required", None)
    assert [t.name for t in required.tools] == ["get_weather", "now"] and required.forced is None
    assert required.tools[1].parameters == {"type": "object", "properties": {}}  # no parameters: no arguments
    assert tool_calling(TOOLS, named("now"), False).forced == "now"
    assert tool_calling(TOOLS, None, None) == tool_calling(TOOLS, "auto", None)  # tools without a choice: "auto"
    assert tool_calling(TOOLS, "auto", None).auto and not required.auto
    bad = [
        (TOOLS, "sometimes", "tool_choice", "must be"),
        (None, "required", "tool_choice", "no tools"),
        (TOOLS, named("rain"), "tool_choice", "not among the tools"),
        (TOOLS + TOOLS[:1], "required", "tools", "given twice"),
        ([ToolDef.model_validate({"type": "function", "function": {"name": "a b"}})], "required",
         "tools[0].function.name", "letters"),
        ([ToolDef.model_validate({"type": "function", "function": {"name": "x", "parameters": {"type": "nope"}}})],
         "required", "tools[0].function.parameters", 'Unsupported type "nope"'),
    ]
    for tools, choice, param, message in bad:
        with pytest.raises(InvalidRequest, match=message) as info:
            tool_calling(tools, choice, None)
        assert info.value.param == param


def test_the_grammar_admits_exactly_the_calls_asked_for() -> None:
    required = json.loads(tool_calling(TOOLS, "required", None).grammar().spec)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}],
                        required)
    for wrong in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "rain", "parameters": {}}],
                  [{"name": "now"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required)
    one = json.loads(tool_calling(TOOLS, "required", False).grammar().spec)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, one)
    forced = tool_calling(TOOLS, named("get_weather"), None).grammar()
    assert forced.kind is GrammarKind.JSON_SCHEMA and json.loads(forced.spec) == WEATHER
    auto = tool_calling(TOOLS, "auto", None).grammar()  # calls, or text that does not begin with "["
    assert auto.kind is GrammarKind.EBNF
    import xgrammar

    def accepts(text: str) -> bool:
        return xgrammar.testing._is_grammar_accept_string(auto.spec, text)

    assert accepts('[{"name": "now", "parameters": {}}]') and accepts("It is sunny.") and accepts("")
    assert accepts(' [{"name": "now", "parameters": {}}]') and accepts(" It is [sunny].")
    assert not accepts('[{"name": "rain", "parameters": {}}]') and not accepts(" [not a call")


def test_the_model_sees_its_tools_and_earlier_calls_in_one_format() -> None:
    calling = tool_calling(TOOLS, "required", None)
    history = [ChatMessage("user", "Weather in Oslo?"),
               ChatMessage("assistant", "", (ToolCallMade("call_1", "get_weather", {"city": "Oslo"}),)),
               ChatMessage("tool", "3 C, rain", tool_call_id="call_1")]
    out = rendered(history, calling, fallback=True)
    assert out[0].role == "system" and '"name": "get_weather"' in out[0].content and "JSON array" in out[0].content
    assert json.loads(out[2].content) == [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    assert out[3] == ChatMessage("tool", "3 C, rain")  # the fallback transcript writes "Tool: ..."
    own = rendered([ChatMessage("system", "Be brief."), *history], None, fallback=False)
    assert own[0] == ChatMessage("system", "Be brief.")  # no tools asked for: no instructions
    assert own[3].role == "user" and own[3].content.endswith("3 C, rain")  # a model's template may not know "tool"
    merged = rendered([ChatMessage("system", "Be brief."), *history], calling, fallback=False)
    assert merged[0].content.startswith("Be brief.\n\nYou can call these functions")


def test_calls_are_read_back_from_the_text_and_streamed_as_openai_does() -> None:
    required = tool_calling(TOOLS, "required", None)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]'
    calls = required.calls(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("now", {})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert required.calls(text[:20]) is None  # cut short by max_tokens
    assert required.calls('{"name": "now"}') is None and required.calls('[{"name": "now"}]') is None
    stream = ToolCallStream(required)
    assert all(stream.delta(text[i:i + 7]).tool_calls is None for i in range(0, len(text), 7))
    last, reason = stream.finish("stop")
    assert reason == "tool_calls" and [d.function.name for d in last.tool_calls] == ["get_weather", "now"]
    cut = ToolCallStream(required)
    cut.delta(text[:20])
    assert cut.finish("length") == (cut.finish("length")[0], "length") and cut.finish("length")[0].content == text[:20]
    auto = tool_calling(TOOLS, "auto", None)
    assert auto.calls("It is sunny.") is None and auto.calls(text)[1].function.name == "now"
    talking = ToolCallStream(auto)
    assert talking.delta("").content is None and talking.delta(" ").content is None
    assert talking.delta("It is").content == " It is"  # with the white space held
    assert talking.delta(" [sunny]").content == " [sunny]" and talking.finish("stop") == (None, "stop")
    calling = ToolCallStream(auto)
    assert calling.delta(" " + text[:9]).content is None and calling.delta(text[9:]).tool_calls is None
    last, reason = calling.finish("stop")
    assert reason == "tool_calls" and len(last.tool_calls) == 2
    forced = ToolCallStream(tool_calling(TOOLS, named("get_weather"), None))
    first, second = forced.delta('{"city": '), forced.delta('"Oslo"}')
    assert first.tool_calls[0].id and first.tool_calls[0].function.name == "get_weather"
    assert second.tool_calls[0].id is None and second.tool_calls[0].function.arguments == '"Oslo"}'
    assert forced.finish("stop") == (None, "stop")


async def test_a_named_call_over_http_whole_and_streamed(tokenizer, tiny_dir) -> None:
    """Against the scripted target (whose text follows no grammar): the target gets the call's
    grammar and a prompt that lists the tools; the SDK reads the answer as a call, whole and streamed."""
    import openai
    from gateway_fakes import fake_stack

    tools = [tool.model_dump(exclude_none=True) for tool in TOOLS]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    async with fake_stack(tokenizer, str(tiny_dir), max_context_len=4096) as stack:
        sdk = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
        model = stack.gateway.core.model.name
        done = await sdk.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=choice,
                                                 max_tokens=6)
        params = stack.model.prefilled[-1]
        assert json.loads(params.grammar.spec) == WEATHER
        assert "You can call these functions" in tokenizer.decode(stack.model.prefilled_prompts[-1])
        call = done.choices[0].message.tool_calls[0]
        assert done.choices[0].message.content is None and call.function.name == "get_weather"
        assert call.type == "function" and call.id.startswith("call_") and call.function.arguments
        assert done.choices[0].finish_reason == "length"  # (the script's text is cut at max_tokens)
        deltas = [c.choices[0].delta async for c in await sdk.chat.completions.create(
            model=model, messages=messages, tools=tools, tool_choice=choice, max_tokens=6, stream=True) if c.choices]
        parts = [d.tool_calls[0] for d in deltas if d.tool_calls]
        assert parts[0].id and parts[0].function.name == "get_weather" and all(p.index == 0 for p in parts)
        assert "".join(p.function.arguments for p in parts) == call.function.arguments
        assert not any(d.content for d in deltas)
        required = await sdk.chat.completions.create(model=model, messages=messages, tools=tools,
                                                     tool_choice="required", max_tokens=6)
        assert required.choices[0].message.content  # not JSON: given back as text, never dropped
        await stack.wait_until_idle()
