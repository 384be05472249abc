"""Shapes a generation into an OpenAI Responses API object (``/v1/responses``): whole, or as its
stream of typed events.

A response's ``output`` is one ``message`` item (its text as one ``output_text`` part) or, where
the request's tools were called (:mod:`gateway.tools`), one ``function_call`` item per call. A
response that ``max_output_tokens`` cut is ``"incomplete"`` with ``incomplete_details.reason``
``"max_output_tokens"``.

Stream framing: every event is ``event: TYPE`` and ``data: {json}`` with a ``sequence_number``
counting from 0: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, its content (text: ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``;
a call: ``response.function_call_arguments.done``), ``response.output_item.done``, and last
``response.completed`` (or ``response.incomplete``) with the whole response. Text streams as it
comes; calls are sent whole at the end (under ``"auto"`` the first character other than white space
says which it is). A failure after the first event is an ``error`` event, last.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from gateway.choices import Choices
from gateway.errors import GatewayError, UpstreamFailure
from gateway.events import Finished, TextDelta, Usage
from gateway.logprobs import chat_logprobs
from gateway.token_strings import TokenStrings
from gateway.tools import ToolCall, ToolCalling, opens_calls

log = logging.getLogger(__name__)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShape:
    """One response's fixed parts (id, model, time, what the request asked for) and its objects."""

    def __init__(self, model: str, calling: ToolCalling | None, max_output_tokens: int | None,
                 temperature: float | None, top_p: float | None, strings: TokenStrings | None = None) -> None:
        self.strings = strings  # token ids as text, for log-probabilities (when asked for)
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.calling = calling
        self.message_id = _id("msg")
        self._request = {"max_output_tokens": max_output_tokens, "temperature": temperature, "top_p": top_p}

    def response(self, status: str, output: list[dict], usage: Usage | None = None) -> dict[str, Any]:
        calling = self.calling
        tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                  "strict": None} for t in calling.tools] if calling else []
        choice: Any = "none" if calling is None else (
            {"type": "function", "name": calling.forced} if calling.forced else "auto" if calling.auto else "required")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": None, "metadata": {}, "parallel_tool_calls": calling.parallel if calling else True,
            "tool_choice": choice, "tools": tools, "text": {"format": {"type": "text"}}, **self._request,
            "usage": None if usage is None else _usage(usage),
        }

    def message(self, text: str, status: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [_text_part(text, logprobs)] if status != "in_progress" else []}

    def output(self, text: str, reason: str, logprobs: list[dict] | None = None) -> list[dict]:
        """The finished output: the calls the text makes (when tools were asked for and called), else the message."""
        calls = self.calls(text, reason)
        if calls is not None:
            return [_function_call(call) for call in calls]
        return [self.message(text, "completed" if reason != "length" else "incomplete", logprobs)]

    def logprobs(self, deltas: list[TextDelta]) -> list[dict]:
        """The deltas' tokens' log-probabilities as the Responses API shows them ([] when not asked for)."""
        pairs = [pair for delta in deltas for pair in zip(delta.token_ids, delta.logprobs)]
        if not pairs or self.strings is None:
            return []
        return [token.model_dump() for token in chat_logprobs(self.strings, pairs).content]

    def calls(self, text: str, reason: str) -> list[ToolCall] | None:
        calling = self.calling
        if calling is None or (reason != "stop" and not calling.forced):
            return None
        return calling.calls(text)


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _function_call(call: ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call.id, "name": call.function.name,
            "arguments": call.function.arguments, "status": "completed"}


def _usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens, "speculative_decoding": usage.speculative_decoding.to_json()}


def _status(reason: str) -> str:
    return "incomplete" if reason == "length" else "completed"


async def complete(choices: Choices, shape: ResponseShape) -> dict[str, Any]:
    """Runs the generation to its end and returns the whole response."""
    deltas: list[TextDelta] = []
    finished: Finished | None = None
    async with aclosing(choices.generations[0].events()) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                deltas.append(event)
            else:
                finished = event
    if finished is None:
        raise UpstreamFailure("generation ended without a finish reason")
    text, reason = "".join(d.text for d in deltas), finished.finish_reason
    return shape.response(_status(reason), shape.output(text, reason, shape.logprobs(deltas)), finished.usage)


async def stream(choices: Choices, shape: ResponseShape) -> AsyncIterator[str]:
    """The response's events (module docstring)."""
    counter = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(counter), **fields})}\n\n"

    text_item = {"output_index": 0, "item_id": shape.message_id, "content_index": 0}

    def open_message() -> list[str]:
        return [event("response.output_item.added", output_index=0, item=shape.message("", "in_progress")),
                event("response.content_part.added", part=_text_part(""), **text_item)]

    try:
        yield event("response.created", response=shape.response("in_progress", []))
        yield event("response.in_progress", response=shape.response("in_progress", []))
        calling = shape.calling
        mode = "text" if calling is None else "undecided" if calling.auto else "calls"
        deltas: list[TextDelta] = []
        sent = 0  # of deltas, those streamed into the message
        opened = False  # the message item, with text streamed into it
        async with aclosing(choices.generations[0].events()) as events:
            async for item in events:
                if isinstance(item, TextDelta):
                    deltas.append(item)
                    if mode == "undecided" and item.text.strip():
                        mode = "calls" if opens_calls("".join(d.text for d in deltas)) else "text"
                    held = deltas[sent:]  # (under "auto": the white space held until text was certain)
                    if mode == "text" and (item.text or item.logprobs):
                        if not opened:
                            opened = True
                            for opening in open_message():
                                yield opening
                        yield event("response.output_text.delta", delta="".join(d.text for d in held),
                                    logprobs=shape.logprobs(held), **text_item)
                        sent = len(deltas)
                    continue
                text, reason = "".join(d.text for d in deltas), item.finish_reason
                output = shape.output(text, reason, shape.logprobs(deltas))
                if output[0]["type"] == "message":
                    if not opened:  # the text comes whole (held for calls that did not come, or none)
                        for opening in open_message():
                            yield opening
                    if sent < len(deltas):
                        held = deltas[sent:]
                        yield event("response.output_text.delta", delta="".join(d.text for d in held),
                                    logprobs=shape.logprobs(held), **text_item)
                    part = output[0]["content"][0]
                    yield event("response.output_text.done", text=text, logprobs=part["logprobs"], **text_item)
                    yield event("response.content_part.done", part=part, **text_item)
                    yield event("response.output_item.done", output_index=0, item=output[0])
                else:
                    for index, call in enumerate(output):
                        yield event("response.output_item.added", output_index=index,
                                    item={**call, "arguments": "", "status": "in_progress"})
                        yield event("response.function_call_arguments.done", output_index=index, item_id=call["id"],
                                    name=call["name"], arguments=call["arguments"])
                        yield event("response.output_item.done", output_index=index, item=call)
                status = _status(reason)
                yield event(f"response.{status}", response=shape.response(status, output, item.usage))
    except GatewayError as exc:
        log.warning("response stream %s failed: %s", shape.id, exc.message)
        yield event("error", code=exc.code, message=exc.message, param=exc.param)
    except Exception:
        log.exception("response stream %s failed", shape.id)
        yield event("error", code="upstream_error", message="internal error in the gateway", param=None)
