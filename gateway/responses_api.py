"""OpenAI's Responses API (``POST /v1/responses``): its request body, read into the fields every
generation route shares.

The Responses API is the chat API with other names, and what the OpenAI Agents SDK and newer
OpenAI clients send: ``input`` (a string, or items: messages, the model's earlier
``function_call`` items and the client's ``function_call_output`` items), ``instructions`` (a
system message first), ``max_output_tokens``, ``text.format`` (structured output), flat function
``tools``. tandem keeps no responses: ``store`` is accepted and nothing is stored, so
``previous_response_id`` (which asks for a stored one) is refused with a 400, as are
``background`` and ``conversation``; the client sends the whole conversation each time, as with
chat. What comes back is shaped by :mod:`gateway.responses_output`.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.chat_template import ChatMessage, ToolCallMade
from gateway.errors import InvalidRequest
from gateway.response_format import ResponseFormat
from gateway.tools import NamedToolChoice, ToolDef, tool_calling
from gateway.unsupported import refuse_tool, refuse_unsupported, text_of_parts
from gateway.validation import RequestFields
from tandem.rpc.types import Grammar


LOGPROBS = "message.output_text.logprobs"  # the include item that asks for log-probabilities


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class InputText(_Body):
    type: str  # "input_text" or "output_text"; other kinds (an image, a file, audio) are refused by name
    text: str | None = None


class InputItem(_Body):
    """One item of ``input``: a message (``type`` "message" or unset), a ``function_call`` the model
    made, or the ``function_call_output`` the client answers it with."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputText] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    output: str | None = None  # function_call_output


class FunctionTool(_Body):
    type: str  # "function"; a built-in tool (web search, file search, ...) is refused by name
    name: str | None = None
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: str  # "text", "json_object", "json_schema" (and tandem's "regex", "grammar")
    name: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None
    regex: str | None = None
    grammar: str | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    # Extra fields are kept so that the ones asking for what tandem does not do are refused by name.
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    # "none", "auto", "required", or {"type": "function", "name": ...}.
    tool_choice: str | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    # Log-probabilities: with "message.output_text.logprobs" in include, each token's and its
    # top_logprobs (0..20) most probable alternatives', on the output_text part and its deltas.
    include: list[str] | None = None
    top_logprobs: int | None = None
    store: bool | None = None  # accepted; tandem stores nothing
    user: str | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: str | dict | None = None  # a stored prompt template: refused, as tandem stores none
    # tandem extensions, as on the other generation routes
    speculation: str | None = None
    num_speculative_tokens: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    seed: int | None = None
    stream_smoothing: str | None = None

    def to_fields(self) -> RequestFields:
        refuse_unsupported(self.model_extra)
        if self.prompt:
            raise InvalidRequest("prompt (a stored prompt template) is not supported: this server stores none; send "
                                 "instructions and input", param="prompt")
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} is not supported: this server stores no responses; send the whole "
                                     "conversation as input", param=name)
        if self.background:
            raise InvalidRequest("background is not supported by this server; leave it unset", param="background")
        calling = tool_calling(self._tools(), self._tool_choice(), self.parallel_tool_calls)
        grammar = self._grammar()
        if calling is not None and grammar is not None:
            raise InvalidRequest("text.format cannot be combined with tool calls (they have a format of their own)",
                                 param="text.format")
        return RequestFields(
            model=self.model,
            messages=self._messages(),
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            typical_p=self.typical_p,
            bad_words=tuple(self.bad_words or ()),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            seed=self.seed,
            speculation=self.speculation,
            num_speculative_tokens=self.num_speculative_tokens,
            stream_smoothing=("off" if not self.stream and self.stream_smoothing in (None, "auto")
                              else self.stream_smoothing),
            grammar=grammar,
            tool_calling=calling,
            top_logprobs=(self.top_logprobs or 0) if LOGPROBS in (self.include or ()) else None,
        )

    def _messages(self) -> list[ChatMessage]:
        out = [ChatMessage("system", self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, ChatMessage("user", self.input)]
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            if item.type == "function_call":
                if not (item.call_id and item.name and item.arguments is not None):
                    raise InvalidRequest(f"{where}: a function_call needs call_id, name and arguments", param=where)
                try:
                    made = ToolCallMade(item.call_id, item.name, json.loads(item.arguments))
                except json.JSONDecodeError as exc:
                    raise InvalidRequest(f"{where}.arguments is not JSON: {exc}", param=where) from None
                if out and out[-1].role == "assistant" and out[-1].tool_calls:  # calls of one turn: one message
                    out[-1] = ChatMessage("assistant", out[-1].content, (*out[-1].tool_calls, made))
                else:
                    out.append(ChatMessage("assistant", "", (made,)))
            elif item.type == "function_call_output":
                if not item.call_id or item.output is None:
                    raise InvalidRequest(f"{where}: a function_call_output needs call_id and output", param=where)
                out.append(ChatMessage("tool", item.output, tool_call_id=item.call_id))
            else:
                if item.role is None:
                    raise InvalidRequest(f"{where}: a message needs a role", param=f"{where}.role")
                content = item.content
                out.append(ChatMessage(item.role, content if isinstance(content, str) else text_of_parts(
                    content or (), where, {"input_text": "text", "output_text": "text"})))
        return out

    def _tools(self) -> list[ToolDef] | None:
        if self.tools is None:
            return None
        for i, tool in enumerate(self.tools):
            if tool.type != "function":
                raise refuse_tool(tool.type, f"tools[{i}]")
            if not tool.name:
                raise InvalidRequest(f"tools[{i}]: a function tool needs its name", param=f"tools[{i}].name")
        return [ToolDef.model_validate({"type": "function", "function": tool.model_dump(exclude_none=True,
                                                                                        exclude={"type"})})
                for tool in self.tools]

    def _tool_choice(self) -> str | NamedToolChoice | None:
        if isinstance(self.tool_choice, NamedFunctionChoice):
            return NamedToolChoice.model_validate({"type": "function", "function": {"name": self.tool_choice.name}})
        return self.tool_choice

    def _grammar(self) -> Grammar | None:
        """``text.format`` as chat's ``response_format`` reads it (its errors named ``text.format``)."""
        given = self.text.format if self.text is not None and self.text.format is not None else None
        if given is None:
            return None
        body: dict = {"type": given.type, "regex": given.regex, "grammar": given.grammar}
        if given.type == "json_schema":
            body["json_schema"] = {"name": given.name, "schema": given.schema_}
        try:
            return ResponseFormat.model_validate(body).to_grammar()
        except InvalidRequest as error:
            raise InvalidRequest(error.message.replace("response_format", "text.format"),
                                 param="text.format") from None
