"""The OpenAI-compatible HTTP bodies (DESIGN §3), as pydantic models.

Request models check *types* strictly (``"5"`` is not an integer, ``1`` is not a boolean), which
is what turns wrong types into a 400; *values* are checked by :mod:`gateway.validation`, shared
with gRPC, so ``to_fields()`` only reshapes. Unknown fields are ignored, as OpenAI-compatible
servers commonly do, but features tandem does not implement (``suffix``, ``best_of``, and the
fields and content parts :mod:`gateway.unsupported` lists) are refused explicitly rather than
silently ignored: a client that asks for something and gets less back has lost what it asked for.
Tool calls are made through structured output (:mod:`gateway.tools`), which ``response_format``
asks for (:mod:`gateway.response_format`).

Response models mirror OpenAI's objects; the usage object adds ``speculative_decoding``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.chat_template import ChatMessage
from gateway.errors import InvalidRequest
from gateway.response_format import ResponseFormat
from gateway.structured_fields import FIELDS as STRUCTURED_FIELDS, grammar_of
from gateway.template_options import TemplateOptions
from gateway.tools import NamedToolChoice, ToolCall, ToolCallDelta, ToolCallIn, ToolDef, tool_calling
from gateway.unsupported import refuse_unsupported, text_of_parts
from gateway.validation import PromptInput, RequestFields
from tandem.rpc.types import MAX_TOP_LOGPROBS

# ---- requests ---------------------------------------------------------------------------------


class _StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_StrictBody):
    include_usage: bool = False


class TextContentPart(_StrictBody):
    type: Literal["text"]
    text: str


class ContentPart(_StrictBody):
    type: str  # "text" (or an assistant's "refusal"); any other kind (an image, audio, a file) is refused by name
    text: str | None = None
    refusal: str | None = None  # an assistant message's refusal part, read as its text


class ChatMessageIn(_StrictBody):
    role: str
    # A string, or OpenAI's list of content parts (text parts only: tandem serves text models).
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def to_message(self, where: str = "messages") -> ChatMessage:
        if isinstance(self.content, str):
            content = self.content
        else:  # an assistant's refusal part is read as its text
            fields = {"text": "text", "refusal": "refusal"} if self.role == "assistant" else {"text": "text"}
            content = text_of_parts(self.content or (), where, fields)
        calls = tuple(call.made(f"{where}.tool_calls[{i}]") for i, call in enumerate(self.tool_calls or ()))
        return ChatMessage(self.role, content, calls, self.tool_call_id)


class PredictedOutput(_StrictBody):
    """OpenAI's ``prediction``: text the answer is expected to repeat (draft_service.prediction)."""

    type: Literal["content"]
    content: str | list[TextContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` keys are token ids written as JSON strings ("1234")."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not re.fullmatch(r"\s*[0-9]{1,12}\s*", key):
            raise InvalidRequest(f"logit_bias: the key {key!r} is not a token id (a non-negative integer written as a "
                                 "string, e.g. \"1234\")", param="logit_bias")
        out[int(key)] = value
    return out


class _GenerationBody(_StrictBody):
    # Extra fields are kept so that the ones asking for what tandem does not do are refused by name.
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, description="HF transformers', vLLM's and TGI's, (0, 2]; 1: none")
    logit_bias: dict[str, float] | None = None
    # tandem extensions (values checked in gateway.validation, shared with gRPC)
    speculation: str | None = Field(None, description='"auto" (default), "on" or "off"')
    num_speculative_tokens: int | None = Field(None, description="draft length K for this request (1..64)")
    top_k: int | None = Field(None, description="sample from the k most likely tokens (0 = all)")
    min_p: float | None = Field(
        None, description="drop tokens less probable than min_p times the most probable one (vLLM's and llama.cpp's)"
    )
    typical_p: float | None = Field(
        None, description="keep the tokens nearest the entropy, up to this mass (locally typical sampling; 1 = all)"
    )
    bad_words: list[str] | None = Field(None, description="words the answer never spells (vLLM's)")
    allowed_token_ids: list[int] | None = Field(None, description="the only token ids the answer is made of (vLLM's)")
    ignore_eos: bool = Field(False, description="keep generating past the end-of-sequence token")
    stop_token_ids: list[int] | None = Field(None, description="token ids that end the answer (vLLM's extension)")
    skip_special_tokens: bool = Field(
        True, description="leave special tokens' text out of the answer (vLLM's extension; false keeps it)"
    )
    include_stop_str_in_output: bool = Field(
        False, description="return the stop string or stop token that ended the answer (vLLM's extension)"
    )
    min_tokens: int | None = Field(None, description="tokens generated before a stop may end the answer (vLLM's)")
    truncate_prompt_tokens: int | None = Field(None, description="keep only the prompt's last tokens (vLLM's)")
    stream_smoothing: str | None = Field(
        None, description='"auto" paces streamed tokens evenly, "off" sends them as committed (default: the server\'s)'
    )
    response_format: ResponseFormat | None = None
    prediction: PredictedOutput | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _common_fields(self, max_tokens: int | None) -> RequestFields:
        extra = dict(self.model_extra or {})
        grammar = None if self.response_format is None else self.response_format.to_grammar()
        other = grammar_of(extra)  # vLLM's guided_* / structured_outputs, llama.cpp's json_schema / grammar
        if other is not None:
            if grammar is not None:
                raise InvalidRequest(f"ask for structured output one way, not with response_format and {other[1]}",
                                     param=other[1])
            grammar = other[0]
        refuse_unsupported({name: value for name, value in extra.items() if name not in STRUCTURED_FIELDS})
        return RequestFields(
            prediction=None if self.prediction is None else self.prediction.text(),
            logit_bias=_token_keys(self.logit_bias),
            grammar=grammar,
            grammar_param="response_format" if other is None else other[1],
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            model=self.model,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            typical_p=self.typical_p,
            bad_words=tuple(self.bad_words or ()),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            seed=self.seed,
            n=self.n,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            min_tokens=self.min_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            speculation=self.speculation,
            num_speculative_tokens=self.num_speculative_tokens,
            ignore_eos=self.ignore_eos,
            # A whole response has no cadence to smooth: pacing would only delay it. (Any other
            # value goes on to validation, which refuses what is not "auto" or "off".)
            stream_smoothing=(
                "off" if not self.stream and self.stream_smoothing in (None, "auto") else self.stream_smoothing
            ),
        )


class ChatCompletionRequest(_GenerationBody):
    messages: list[ChatMessageIn]
    # OpenAI's newer name for max_tokens; wins when both are given.
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    # "none", "auto", "required", or {"type": "function", "function": {"name": ...}} (gateway.tools).
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's and llama.cpp's chat template controls (gateway.chat_template.TemplateOptions)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def to_fields(self) -> RequestFields:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        calling = tool_calling(self.tools, self.tool_choice, self.parallel_tool_calls)
        if calling is not None and self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequest("response_format cannot be combined with tool calls (they have a format of their "
                                 "own); leave one of them out", param="response_format")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        fields = self._common_fields(max_tokens)
        if calling is not None and fields.grammar is not None:  # asked for by another server's field
            asked = next(name for name in STRUCTURED_FIELDS if (self.model_extra or {}).get(name) is not None)
            raise InvalidRequest(f"{asked} cannot be combined with tool calls (they have a format of their own); "
                                 "leave one of them out", param=asked)
        fields.messages = [m.to_message(f"messages[{i}]") for i, m in enumerate(self.messages)]
        fields.tool_calling = calling
        fields.template = TemplateOptions(self.add_generation_prompt, self.continue_final_message,
                                          dict(self.chat_template_kwargs or {}))
        fields.top_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return fields


class CompletionRequest(_GenerationBody):
    prompt: PromptInput
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_fields(self) -> RequestFields:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}", param="logprobs"
            )
        if self.suffix:
            raise InvalidRequest("suffix is not supported by this server", param="suffix")
        if self.best_of not in (None, 1):
            raise InvalidRequest("best_of must be 1", param="best_of")
        fields = self._common_fields(self.max_tokens)
        fields.prompt = self.prompt
        fields.top_logprobs = self.logprobs
        fields.echo = self.echo
        return fields


# ---- responses --------------------------------------------------------------------------------


class SpeculativeDecodingUsage(BaseModel):
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mode: Literal["speculative", "autoregressive", "mixed"]
    fallbacks: int
    fallback_reason: str | None = None
    empty_rounds: int = 0  # verified blocks that carried no drafts (not counted in rounds)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    # OpenAI's, for a request with a prediction: its tokens that the draft proposed and the target
    # accepted, and those it proposed and the target rejected (0 without one).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's: of prompt_tokens, those served from the target's prefix cache.
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails
    speculative_decoding: SpeculativeDecodingUsage


FinishReason = Literal["stop", "length", "tool_calls"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """Both the non-stream response and each stream chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
