"""Other servers' structured-output fields (gateway.structured_fields): vLLM's guided_* and
structured_outputs, llama.cpp's json_schema and grammar, read on chat and completions as the grammar
response_format would give; two ways at once and bad values refused by name."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequest
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.structured_fields import grammar_of
from tandem.rpc.types import Grammar, GrammarKind

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
JSON = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))


@pytest.mark.parametrize("body, grammar", [
    ({"guided_json": SCHEMA}, JSON),
    ({"guided_json": json.dumps(SCHEMA)}, JSON),  # vLLM takes the schema as text too
    ({"json_schema": SCHEMA}, JSON),  # llama.cpp's
    ({"structured_outputs": {"json": SCHEMA}}, JSON),
    ({"structured_outputs": {"json_object": True}}, Grammar(GrammarKind.JSON_SCHEMA, '{"type": "object"}')),
    ({"guided_regex": "[0-9]{3}"}, Grammar(GrammarKind.REGEX, "[0-9]{3}")),
    ({"structured_outputs": {"regex": "a+", "json": None}}, Grammar(GrammarKind.REGEX, "a+")),
    ({"guided_grammar": 'root ::= "x"'}, Grammar(GrammarKind.EBNF, 'root ::= "x"')),
    ({"grammar": 'root ::= "x"'}, Grammar(GrammarKind.EBNF, 'root ::= "x"')),  # llama.cpp's GBNF
    ({"guided_choice": ["yes", 'say "hi"', "a\\b\n"]},
     Grammar(GrammarKind.EBNF, 'root ::= "yes" | "say \\"hi\\"" | "a\\\\b\\n"')),
    ({"structured_outputs": {"choice": ["x\x01"]}}, Grammar(GrammarKind.EBNF, 'root ::= "x\\x01"')),
])
def test_each_field_is_the_grammar_response_format_would_give(body, grammar) -> None:
    assert grammar_of(body) == (grammar, next(iter(body)))
    for route, base in ((ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
                        (CompletionRequest, {"prompt": "hi"})):
        assert route.model_validate({**base, **body}).to_fields().grammar == grammar


def test_none_set_is_free_text_and_null_is_not_set() -> None:
    assert grammar_of({}) is None and grammar_of({"guided_json": None, "grammar": None, "user": "x"}) is None
    fields = CompletionRequest.model_validate({"prompt": "hi", "guided_regex": None}).to_fields()
    assert fields.grammar is None


@pytest.mark.parametrize("body, param, said", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "one way"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {}}, "structured_outputs", "got none"),
    ({"structured_outputs": "json"}, "structured_outputs", "an object"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_json": [1, 2]}, "guided_json", "JSON Schema"),
    ({"guided_choice": []}, "guided_choice", "non-empty strings"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"grammar": 5}, "grammar", "non-empty string"),
])
def test_two_ways_at_once_and_bad_values_are_refused_by_name(body, param, said) -> None:
    with pytest.raises(InvalidRequest) as refused:
        CompletionRequest.model_validate({"prompt": "hi", **body}).to_fields()
    assert refused.value.param == param and said in refused.value.message, refused.value.message
    # response_format "text" asks for free text: another field may still ask for a grammar
    text_too = {"prompt": "hi", "response_format": {"type": "text"}, "guided_regex": "a"}
    assert CompletionRequest.model_validate(text_too).to_fields().grammar == Grammar(GrammarKind.REGEX, "a")


def test_with_tool_calls_another_format_is_refused_not_dropped() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "guided_regex": "a+"}
    with pytest.raises(InvalidRequest) as refused:
        ChatCompletionRequest.model_validate(body).to_fields()
    assert refused.value.param == "guided_regex" and "tool calls" in refused.value.message
    body["tool_choice"] = "none"  # no tool calls asked for: the regex stands
    assert ChatCompletionRequest.model_validate(body).to_fields().grammar == Grammar(GrammarKind.REGEX, "a+")
