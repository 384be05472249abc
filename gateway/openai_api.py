"""Shapes a :class:`gateway.generation.Generation` into OpenAI responses: whole or as SSE.

Stream framing (DESIGN §3): every event is ``data: {json}\\n\\n``; a chat stream opens with a chunk
carrying the assistant role; the last choice chunk has the finish reason; with
``stream_options.include_usage`` a chunk with empty ``choices`` and the usage follows; and
``data: [DONE]`` always comes last, also after an error, which is sent as an OpenAI error object
(the HTTP status is already 200 by then).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from gateway.choices import Choices, combined_usage
from gateway.errors import GatewayError, UpstreamFailure
from gateway.events import Finished, TextDelta, Usage
from gateway.generation import Generation
from gateway.logprobs import chat_logprobs, completion_logprobs, echoed_prompt
from gateway.token_strings import TokenStrings
from gateway.tool_stream import ToolCallStream
from gateway.output import merged
from gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionTokensDetails,
    CompletionResponse,
    PromptTokensDetails,
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
    # Turns the log-probabilities of tokens into their texts (they come only when asked for).
    strings: TokenStrings | None = field(default=None, compare=False, repr=False)
    echo: bool = False  # a completion that repeats its prompt first
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
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_prompt_tokens),
        completion_tokens_details=CompletionTokensDetails(
            accepted_prediction_tokens=usage.speculative_decoding.prediction_accepted,
            rejected_prediction_tokens=usage.speculative_decoding.prediction_drafts
            - usage.speculative_decoding.prediction_accepted),
        speculative_decoding=SpeculativeDecodingUsage(**usage.speculative_decoding.to_json()),
    )


async def complete(choices: Choices, meta: ResponseMeta) -> ChatCompletionResponse | CompletionResponse:
    """Runs started choices to their ends and returns the whole response."""
    finished = await asyncio.gather(*(_whole(generation, meta, i) for i, generation in enumerate(choices.generations)))
    usage = usage_info(combined_usage([usage for _, usage in finished], choices.per_prompt))
    if meta.kind == "chat":
        return ChatCompletionResponse(id=meta.id, created=meta.created, model=meta.model,
                                      choices=[choice for choice, _ in finished], usage=usage)
    return CompletionResponse(id=meta.id, created=meta.created, model=meta.model,
                              choices=[choice for choice, _ in finished], usage=usage)


async def _whole(generation: Generation, meta: ResponseMeta, index: int) -> tuple[BaseModel, Usage]:
    """One choice run to its end: its choice object and its usage."""
    texts: list[str] = []
    deltas: list[TextDelta] = []
    finished: Finished | None = None
    async with aclosing(generation.events()) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                texts.append(event.text)
                deltas.append(event)
            else:
                finished = event
    if finished is None:  # events() always ends with Finished or raises; guard the invariant
        raise UpstreamFailure("generation ended without a finish reason")
    text, reason = "".join(texts), finished.finish_reason
    if meta.kind == "chat":
        logprobs = _chat_logprobs(meta, merged(deltas))
        message = AssistantMessage(content=text)
        calling = generation.request.tool_calling
        calls = None if calling is None or (reason != "stop" and not calling.forced) else calling.calls(text)
        if calls is not None:
            message = AssistantMessage(content=None, tool_calls=calls)
            reason = calling.finish_reason if reason == "stop" else reason
        return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=reason), finished.usage
    prompt, echoed = _echo(generation, meta)
    logprobs = _completion_logprobs(meta, deltas, len(prompt), echoed)
    return CompletionChoice(index=index, text=prompt + text, logprobs=logprobs, finish_reason=reason), finished.usage


async def stream(choices: Choices, meta: ResponseMeta) -> AsyncIterator[str]:
    """SSE events of started choices, ``data: [DONE]`` last whatever happens. Each choice's chunks
    carry its index; the usage chunk (asked for) comes after every choice's finish."""
    try:
        sent = [0] * len(choices.generations)  # characters streamed per choice (completion logprobs' offsets)
        tools = [ToolCallStream(g.request.tool_calling) if meta.kind == "chat" and g.request.tool_calling else None
                 for g in choices.generations]
        for i, generation in enumerate(choices.generations):
            if meta.kind == "chat":
                yield _event(_chat_chunk(meta, ChatDelta(role="assistant", content=""), index=i))
            if meta.echo:
                prompt, echoed = _echo(generation, meta)
                yield _event(_completion_chunk(meta, prompt, logprobs=_completion_logprobs(meta, [], 0, echoed),
                                               index=i))
                sent[i] = len(prompt)
        usages: dict[int, Usage] = {}  # by choice, as they finish
        async for i, event in choices.events():
            if isinstance(event, TextDelta):
                if tools[i] is not None:
                    delta = tools[i].delta(event.text)
                    if delta.tool_calls or delta.content or event.logprobs:
                        yield _event(_chat_chunk(meta, delta, logprobs=_chat_logprobs(meta, event), index=i))
                elif event.text or event.logprobs:  # a token's log-probabilities go out even before its text
                    yield _event(_text_chunk(meta, event, sent[i], i))
                    sent[i] += len(event.text)
                continue
            reason = event.finish_reason
            if tools[i] is not None:
                last, reason = tools[i].finish(reason)
                if last is not None:
                    yield _event(_chat_chunk(meta, last, index=i))
            yield _event(_finish_chunk(meta, reason, i))
            usages[i] = event.usage
        if meta.include_usage and len(usages) == len(sent):
            in_order = [usages[i] for i in range(len(sent))]
            yield _event(_usage_chunk(meta, usage_info(combined_usage(in_order, choices.per_prompt))))
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


def _chat_chunk(
    meta: ResponseMeta, delta: ChatDelta, finish_reason: str | None = None, logprobs: ChatLogprobs | None = None,
    index: int = 0,
) -> ChatCompletionChunk:
    choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
    return ChatCompletionChunk(id=meta.id, object="chat.completion.chunk", created=meta.created,
                               model=meta.model, choices=[choice])


def _completion_chunk(
    meta: ResponseMeta, text: str, finish_reason: str | None = None, logprobs: CompletionLogprobs | None = None,
    index: int = 0,
) -> CompletionResponse:
    choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
    return CompletionResponse(id=meta.id, object="text_completion", created=meta.created,
                              model=meta.model, choices=[choice])


def _text_chunk(meta: ResponseMeta, delta: TextDelta, sent: int, index: int) -> BaseModel:
    """A delta's text and its tokens' log-probabilities (``sent``: characters streamed before it)."""
    if meta.kind == "chat":
        return _chat_chunk(meta, ChatDelta(content=delta.text), logprobs=_chat_logprobs(meta, delta), index=index)
    return _completion_chunk(meta, delta.text, logprobs=_completion_logprobs(meta, [delta], sent), index=index)


def _chat_logprobs(meta: ResponseMeta, delta: TextDelta) -> ChatLogprobs | None:
    if not delta.logprobs or meta.strings is None:
        return None
    return chat_logprobs(meta.strings, list(zip(delta.token_ids, delta.logprobs)))


def _echo(generation: Generation, meta: ResponseMeta) -> tuple[str, list]:
    """The echoed prompt's text and its tokens' entries for :func:`_completion_logprobs` ("", [] without echo)."""
    if not meta.echo or meta.strings is None:
        return "", []
    logprobs = generation.prompt_logprobs() if generation.request.prompt_logprobs else None
    return echoed_prompt(meta.strings.tokenizer, generation.request.prompt_token_ids, logprobs)


def _completion_logprobs(
    meta: ResponseMeta, deltas: list[TextDelta], sent: int, echoed: list | None = None
) -> CompletionLogprobs | None:
    """The log-probabilities of the deltas' tokens (after ``echoed``, an echoed prompt's entries),
    each token's text offset being where the text stood before its delta (``sent``: the characters
    before the first delta)."""
    found = list(echoed or ())
    for delta in deltas:
        found += [(token, lp, sent) for token, lp in zip(delta.token_ids, delta.logprobs)]
        sent += len(delta.text)
    if not found or meta.strings is None:
        return None
    return completion_logprobs(meta.strings, found)


def _finish_chunk(meta: ResponseMeta, finish_reason: str, index: int) -> BaseModel:
    if meta.kind == "chat":
        return _chat_chunk(meta, ChatDelta(), finish_reason, index=index)
    return _completion_chunk(meta, "", finish_reason, index=index)


def _usage_chunk(meta: ResponseMeta, usage: UsageInfo) -> BaseModel:
    if meta.kind == "chat":
        return ChatCompletionChunk(id=meta.id, object="chat.completion.chunk", created=meta.created,
                                   model=meta.model, choices=[], usage=usage)
    return CompletionResponse(id=meta.id, object="text_completion", created=meta.created,
                              model=meta.model, choices=[], usage=usage)
