"""Shapes a :class:`gateway.generation.Generation` into OpenAI responses: whole or as SSE.

Stream framing (DESIGN §3): every event is ``data: {json}\\n\\n``; a chat stream opens with a chunk
carrying the assistant role; the last choice chunk has the finish reason; with
``stream_options.include_usage`` a chunk with empty ``choices`` and the usage follows; and
``data: [DONE]`` always comes last, also after an error, which is sent as an OpenAI error object
(the HTTP status is already 200 by then).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from gateway.errors import GatewayError, UpstreamFailure
from gateway.events import Finished, TextDelta, Usage
from gateway.generation import Generation
from gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    SpeculativeDecodingUsage,
    UsageInfo,
)

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response repeats."""

    kind: Literal["chat", "completion"]
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
            object.__setattr__(self, "id", f"{prefix}-{uuid.uuid4().hex}")


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        speculative_decoding=SpeculativeDecodingUsage(**usage.speculative_decoding.to_json()),
    )


async def complete(generation: Generation, meta: ResponseMeta) -> ChatCompletionResponse | CompletionResponse:
    """Runs a started generation to the end and returns the whole response."""
    texts: list[str] = []
    finished: Finished | None = None
    async with aclosing(generation.events()) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                texts.append(event.text)
            else:
                finished = event
    if finished is None:  # events() always ends with Finished or raises; guard the invariant
        raise UpstreamFailure("generation ended without a finish reason")
    text, usage = "".join(texts), usage_info(finished.usage)
    reason = finished.finish_reason
    if meta.kind == "chat":
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=reason)
        return ChatCompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=[choice], usage=usage)
    choice = CompletionChoice(text=text, finish_reason=reason)
    return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=[choice], usage=usage)


async def stream(generation: Generation, meta: ResponseMeta) -> AsyncIterator[str]:
    """SSE events of a started generation, ``data: [DONE]`` last whatever happens."""
    try:
        if meta.kind == "chat":
            yield _event(_chat_chunk(meta, ChatDelta(role="assistant", content="")))
        async with aclosing(generation.events()) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    if event.text:
                        yield _event(_text_chunk(meta, event.text))
                    continue
                yield _event(_finish_chunk(meta, event.finish_reason))
                if meta.include_usage:
                    yield _event(_usage_chunk(meta, usage_info(event.usage)))
    except GatewayError as exc:
        log.warning("stream %s failed: %s", meta.id, exc.message)
        yield f"data: {json.dumps(exc.to_openai())}\n\n"
    except Exception:
        log.exception("stream %s failed", meta.id)
        yield f"data: {json.dumps(UpstreamFailure('internal error in the gateway').to_openai())}\n\n"
    yield DONE


def _event(chunk: BaseModel) -> str:
    # exclude_unset: a content delta carries no "role", the final delta is {} (as OpenAI sends).
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def _chat_chunk(meta: ResponseMeta, delta: ChatDelta, finish_reason: str | None = None) -> ChatCompletionChunk:
    choice = ChatChunkChoice(index=0, delta=delta, logprobs=None, finish_reason=finish_reason)
    return ChatCompletionChunk(id=meta.id, object="chat.completion.chunk", created=meta.created,
                               model=meta.model, choices=[choice])


def _completion_chunk(meta: ResponseMeta, text: str, finish_reason: str | None = None) -> CompletionResponse:
    choice = CompletionChoice(index=0, text=text, logprobs=None, finish_reason=finish_reason)
    return CompletionResponse(id=meta.id, object="text_completion", created=meta.created,
                              model=meta.model, choices=[choice])


def _text_chunk(meta: ResponseMeta, text: str) -> BaseModel:
    if meta.kind == "chat":
        return _chat_chunk(meta, ChatDelta(content=text))
    return _completion_chunk(meta, text)


def _finish_chunk(meta: ResponseMeta, finish_reason: str) -> BaseModel:
    if meta.kind == "chat":
        return _chat_chunk(meta, ChatDelta(), finish_reason)
    return _completion_chunk(meta, "", finish_reason)


def _usage_chunk(meta: ResponseMeta, usage: UsageInfo) -> BaseModel:
    if meta.kind == "chat":
        return ChatCompletionChunk(id=meta.id, object="chat.completion.chunk", created=meta.created,
                                   model=meta.model, choices=[], usage=usage)
    return CompletionResponse(id=meta.id, object="text_completion", created=meta.created,
                              model=meta.model, choices=[], usage=usage)
