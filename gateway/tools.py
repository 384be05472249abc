"""Tool calling (OpenAI's ``tools`` and ``tool_choice``) through structured output.

A request with ``tools`` gets calls that are valid by construction, from any model: the target's
grammar (``target_service.grammar``) admits only

- for a named function (``tool_choice: {"type": "function", "function": {"name": F}}``), its
  arguments: one JSON object valid under the function's ``parameters``;
- for ``"required"``, a JSON array of one or more calls, ``[{"name": N, "parameters": {...}}, ...]``,
  each item valid under its own function's schema (one item if ``parallel_tool_calls`` is false);
- for ``"auto"`` (the default with tools), either such an array or text that does not begin with
  ``[`` (white space aside): the model decides with its first token, and the first character other
  than white space says what it decided.

The response carries calls as ``message.tool_calls`` (``finish_reason`` ``"tool_calls"``, or
``"stop"`` for a named function, as OpenAI answers) and text as ``content``. The model learns the
tools from a system message tandem writes (:func:`rendered`), and earlier calls and their results in
the conversation are written the same way, so the model sees one format throughout.

Invariant: the text a tool-calling generation produces is parsed by :meth:`ToolCalling.calls` into
the calls it returns, or returned as content (text, or calls cut short by ``max_tokens``), never dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from gateway.chat_template import ChatMessage, ToolCallMade
from gateway.errors import InvalidRequest
from gateway.unsupported import refuse_tool
from tandem.grammar import GrammarError, array_or_text, check_json_schema
from tandem.rpc.types import Grammar, GrammarKind

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
EMPTY_OBJECT = {"type": "object", "properties": {}}


# ---- request bodies ----------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema of the arguments object; unset: no arguments
    strict: bool | None = None  # the schema is followed exactly either way


class ToolDef(_Body):
    type: str  # "function"; a built-in tool (web search, ...) is refused by name
    function: FunctionDef | None = None


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class FunctionCallIn(_Body):
    name: str
    arguments: str  # a JSON object, as the call returned it


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def made(self, where: str) -> ToolCallMade:
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{where}.function.arguments is not JSON: {exc}", param=where) from None
        return ToolCallMade(self.id or "", self.function.name, arguments)


# ---- response objects --------------------------------------------------------------------------


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


def opens_calls(text: str) -> bool:
    """Under ``"auto"``: whether an answer whose text so far is ``text`` (holding a character other
    than white space) is calls rather than text: its first such character is ``[``."""
    return text.lstrip().startswith("[")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- what a request asks for -------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON Schema of the arguments object


@dataclass(frozen=True)
class ToolCalling:
    """The calls a request asks for: of ``forced`` alone, or (None: ``"required"``) of any tools, or
    (``auto``) calls or text."""

    tools: tuple[Tool, ...]
    forced: str | None = None
    parallel: bool = True
    auto: bool = False

    @property
    def finish_reason(self) -> str:
        return "stop" if self.forced else "tool_calls"

    def grammar(self) -> Grammar:
        by_name = {tool.name: tool for tool in self.tools}
        if self.forced is not None:
            return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(by_name[self.forced].parameters))
        item = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                           "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]}
        calls = {"type": "array", "items": item, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}
        if self.auto:
            return Grammar(GrammarKind.EBNF, array_or_text(json.dumps(calls)))
        return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(calls))

    def instructions(self) -> str:
        """The system text that tells the model its tools and the form of its answer."""
        listed = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
                           for t in self.tools)
        if self.forced is not None:
            answer = f"Call the function {self.forced}: answer with its arguments as one JSON object."
        else:
            answer = ('Answer with a JSON array of the calls to make, each {"name": <function name>, '
                      '"parameters": <its arguments>}' + ("." if self.parallel else ", one call only."))
            if self.auto:
                answer = f"If calling them helps to answer: {answer[0].lower()}{answer[1:]} Otherwise answer in text."
        return f"You can call these functions:\n{listed}\n{answer}"

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls in a finished answer: a named function's call has the text as its arguments
        (cut short, as OpenAI returns them, if max_tokens cut it); ``"required"`` calls are parsed
        from the text, None where it is not whole."""
        if self.forced is not None:
            return [ToolCall(id=call_id(), function=FunctionCall(name=self.forced, arguments=text))]
        if self.auto and not opens_calls(text):
            return None  # the model answered in text
        try:
            value = json.loads(text)
            return [ToolCall(id=call_id(), function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"])))
                    for c in value]
        except (json.JSONDecodeError, TypeError, KeyError):  # not whole (or, against the grammar, not calls)
            return None


def tool_calling(tools: list[ToolDef] | None, choice: str | NamedToolChoice | None, parallel: bool | None
                 ) -> ToolCalling | None:
    """The request's tool calling, checked; None where it asks for none (no tools, or ``"none"``)."""
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise InvalidRequest(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                             param="tool_choice")
    if choice == "none":
        return None
    if not tools:
        raise InvalidRequest("tool_choice asks for tool calls, but the request has no tools", param="tool_choice")
    found: dict[str, Tool] = {}
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise refuse_tool(tool.type, f"tools[{i}]")
        if tool.function is None:
            raise InvalidRequest(f"tools[{i}]: a function tool needs its function", param=f"tools[{i}].function")
        name = tool.function.name
        if not NAME.fullmatch(name):
            raise InvalidRequest(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                                 param=f"tools[{i}].function.name")
        if name in found:
            raise InvalidRequest(f"tools[{i}]: the function name {name!r} is given twice", param="tools")
        found[name] = Tool(name, tool.function.description or "", tool.function.parameters or EMPTY_OBJECT)
        _check_schema(found[name].parameters, f"tools[{i}].function.parameters")
    forced = None
    if isinstance(choice, NamedToolChoice):
        forced = choice.function.name
        if forced not in found:
            raise InvalidRequest(f"tool_choice names the function {forced!r}, which is not among the tools",
                                 param="tool_choice")
    return ToolCalling(tuple(found.values()), forced, parallel is not False, auto=choice == "auto")


def _check_schema(schema: dict, where: str) -> None:
    """Refuses, here and with the field's name, a schema the target's grammar compiler would refuse."""
    try:
        check_json_schema(json.dumps(schema))
    except GrammarError as error:
        raise InvalidRequest(f"{where} is not a JSON Schema this server can follow: {error}", param=where) from None


def rendered(messages: Sequence[ChatMessage], calling: ToolCalling | None, fallback: bool) -> list[ChatMessage]:
    """The conversation as the chat template gets it: the tool instructions first (in the system
    message, or one of their own), earlier calls as their JSON text, and results as ``tool``
    turns (``user`` turns for a model's own template, which may not know the role)."""
    out: list[ChatMessage] = []
    for message in messages:
        content = message.content
        if message.tool_calls:
            made = json.dumps([{"name": c.name, "parameters": c.arguments} for c in message.tool_calls])
            content = f"{content}\n{made}" if content else made
        if message.role == "tool" and not fallback:
            out.append(ChatMessage("user", f"Result of the call {message.tool_call_id or ''}: {content}"))
        else:
            out.append(ChatMessage(message.role, content))
    if calling is not None:
        if out and out[0].role in ("system", "developer"):
            out[0] = ChatMessage(out[0].role, f"{out[0].content}\n\n{calling.instructions()}")
        else:
            out.insert(0, ChatMessage("system", calling.instructions()))
    return out
