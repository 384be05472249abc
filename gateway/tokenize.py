"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, over HTTP.

Clients need token ids for ``logit_bias`` and ``prompt`` given as ids, and counts to fit a prompt in
the context; the tokenizer they would load themselves may not be the served one. The shapes are
vLLM's (also close to llama-server's): a ``prompt`` is tokenized as ``/v1/completions`` prefills it
(with the tokenizer's special tokens, BOS, unless ``add_special_tokens`` is false), ``messages`` as
``/v1/chat/completions`` does (the model's chat template, ending with an open assistant turn unless
``add_generation_prompt`` is false; ``continue_final_message`` and ``chat_template_kwargs`` as
there). Invariant: the ids returned for a request's prompt or messages are exactly the ones a
generation request with the same input prefills.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from gateway.errors import InvalidRequest
from gateway.protocol import ChatMessageIn
from gateway.served_model import ServedModel
from gateway.template_options import TemplateOptions
from gateway.tools import NamedToolChoice, ToolDef, tool_calling
from gateway.validation import RequestValidator


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True  # prompt only: the chat template writes its own
    add_generation_prompt: bool = True  # messages only, as a chat request's (gateway.chat_template.TemplateOptions)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None  # messages only: as a chat request with them prefills (gateway.tools)
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # each token's piece in the vocabulary, with return_token_strs


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(body: TokenizeRequest, model: ServedModel, validator: RequestValidator) -> TokenizeResponse:
    validator.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        calling = tool_calling(body.tools, body.tool_choice, body.parallel_tool_calls)
        messages = [m.to_message(f"messages[{i}]") for i, m in enumerate(body.messages)]
        options = TemplateOptions(body.add_generation_prompt, body.continue_final_message,
                                  dict(body.chat_template_kwargs or {}))
        tokens = validator.chat_prompt(messages, options, calling)
    else:  # as RequestValidator tokenizes a completion's text
        tokens = model.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
    strs = [str(piece) for piece in model.tokenizer.convert_ids_to_tokens(tokens)] if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=model.max_context_len, tokens=tokens, token_strs=strs)


def detokenize(body: DetokenizeRequest, model: ServedModel, validator: RequestValidator) -> DetokenizeResponse:
    validator.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < model.vocab_size]
    if bad:
        raise InvalidRequest(f"tokens holds ids outside the vocabulary [0, {model.vocab_size}): {bad[:8]}",
                             param="tokens")
    return DetokenizeResponse(prompt=model.tokenizer.decode(body.tokens))
