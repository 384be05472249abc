"""The one place where client input is checked and tokenized, for HTTP and gRPC alike.

Transport layers only check *types* (pydantic for HTTP bodies, protobuf for gRPC) and fill in a
:class:`RequestFields`; :class:`RequestValidator` checks *values* against the served model and
returns a :class:`gateway.request.GenerationRequest`, or raises
:class:`gateway.errors.InvalidRequest` whose message names the offending field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Union

from gateway.chat_template import ChatMessage, ChatTemplateError
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.request import GenerationRequest, SamplingParams, Smoothing, Speculation
from gateway.sampling_defaults import RANGES, SamplingDefaults, in_range
from gateway.served_model import ServedModel
from gateway.template_options import TemplateOptions
from gateway.token_masks import allowed_token_ids, bad_word_sequences
from gateway.tools import ToolCalling, rendered
from tandem.rpc.types import (
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_PREDICTION_TOKENS,
    MAX_TOP_LOGPROBS,
    Grammar,
)

# Choices one request may ask for (n, times the prompts of a completions batch): each takes a target
# session and an admission slot.
MAX_CHOICES = 16

# OpenAI's default for /v1/completions; chat defaults to the gateway's setting.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_SPECULATIVE_TOKENS = 64
# Each stop token id is checked against every committed token, in the target and the gateway.
MAX_STOP_TOKEN_IDS = 64
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_SEED = 2**64 - 1

# As OpenAI's /v1/completions accepts it: text, token ids, or a batch of either (prompt_batch).
PromptInput = Union[str, list[int], list[str], list[list[int]]]


@dataclass
class RequestFields:
    """One request as the client sent it, with types checked but values not yet."""

    model: str | None = None
    prompt: PromptInput | None = None  # completions
    messages: list[ChatMessage] | None = None  # chat
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None  # vLLM's and llama.cpp's; None: 0 (none)
    typical_p: float | None = None  # Hugging Face's and llama.cpp's; None: 1 (none)
    seed: int | None = None
    n: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the answer besides EOS (vLLM's extension)
    include_stop_str_in_output: bool = False  # the matched stop string or stop token's text is returned
    skip_special_tokens: bool = True  # special tokens' text is left out of the answer (vLLM's extension)
    min_tokens: int | None = None  # the answer's first tokens are never a stop (vLLM's extension)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last tokens (vLLM's extension)
    speculation: str | None = None
    num_speculative_tokens: int | None = None
    ignore_eos: bool = False
    stream_smoothing: str | None = None
    # None: no log-probabilities; n: each token's and its n most probable alternatives'.
    top_logprobs: int | None = None
    echo: bool = False  # completions: the response repeats the prompt (with its log-probabilities)
    grammar: Grammar | None = None  # structured output: the text is a sentence of this grammar
    grammar_param: str = "response_format"  # the field that asked for it (gateway.structured_fields)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # HF transformers', vLLM's and TGI's; None: 1 (none)
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    bad_words: tuple[str, ...] = ()  # words the answer never spells (vLLM's; gateway.token_masks)
    allowed_token_ids: tuple[int, ...] | None = None  # the only tokens the answer is made of (vLLM's); None: all
    tool_calling: ToolCalling | None = None  # chat: the tool calls asked for (gateway.tools)
    prediction: str | None = None  # text the answer is expected to repeat (OpenAI's predicted output)
    template: TemplateOptions = field(default_factory=TemplateOptions)  # chat: how the messages are rendered


def _or(sent, model_default, openai_default):
    """A sampling field's value: what the request sent, else the model's default, else OpenAI's."""
    return sent if sent is not None else model_default if model_default is not None else openai_default


def prompt_batch(fields: RequestFields) -> list[RequestFields]:
    """A completions request's prompts, each as a request of its own: OpenAI's batch (a list of
    texts, or of token-id lists) is answered as that many requests' choices, prompt after prompt
    (choice ``i * n + j`` is prompt i's choice j). Any other request is one."""
    prompt = fields.prompt
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        return [replace(fields, prompt=one) for one in prompt]
    return [fields]


class RequestValidator:
    def __init__(self, model: ServedModel, default_chat_max_tokens: int,
                 defaults: SamplingDefaults = SamplingDefaults()) -> None:
        self._model = model
        self._default_chat_max_tokens = default_chat_max_tokens
        self._defaults = defaults  # what a request that leaves a sampling field out gets

    def validate(self, fields: RequestFields) -> GenerationRequest:
        self.check_model(fields.model)
        n = 1 if fields.n is None else fields.n
        if not 1 <= n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}, got {n}", param="n")
        sampling = self._sampling(fields)
        speculation, k = self._speculation(fields)
        stop = self._stop(fields.stop)
        stop_token_ids = self._stop_token_ids(fields.stop_token_ids)
        if (fields.messages is None) == (fields.prompt is None):
            raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
        if fields.messages is not None:
            if fields.template.continue_final_message and (fields.grammar is not None or fields.tool_calling):
                asked = "tools" if fields.tool_calling is not None else fields.grammar_param
                raise InvalidRequest(f"continue_final_message cannot be combined with {asked}: a format constrains "
                                     "an answer from its start, not the rest of a message", param=asked)
            prompt_ids = self.chat_prompt(fields.messages, fields.template, fields.tool_calling)
            param = "messages"
            stop += tuple(s for s in self._model.chat.stop_strings if s not in stop)
            stop_token_ids += tuple(t for t in self._model.chat.stop_token_ids if t not in stop_token_ids)
            default_max_tokens = self._default_chat_max_tokens
        else:
            if fields.template != TemplateOptions():
                raise InvalidRequest("add_generation_prompt, continue_final_message and chat_template_kwargs shape "
                                     "how messages are rendered; a prompt takes none of them", param="prompt")
            prompt_ids, param = self._completion_prompt(fields.prompt), "prompt"
            default_max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        prompt_ids = self._truncated(prompt_ids, fields.truncate_prompt_tokens)
        max_tokens = self._max_tokens(fields.max_tokens, default_max_tokens, len(prompt_ids), param)
        min_tokens = fields.min_tokens or 0
        if not 0 <= min_tokens <= max_tokens:
            raise InvalidRequest(f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {min_tokens}",
                                 param="min_tokens")
        return GenerationRequest(
            prompt_token_ids=tuple(prompt_ids),
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop,
            stop_token_ids=stop_token_ids,
            include_stop_str_in_output=fields.include_stop_str_in_output,
            skip_special_tokens=fields.skip_special_tokens,
            min_tokens=min_tokens,
            ignore_eos=fields.ignore_eos,
            speculation=speculation,
            num_speculative_tokens=k,
            stream_smoothing=self._smoothing(fields.stream_smoothing),
            top_logprobs=self._top_logprobs(fields.top_logprobs),
            echo=fields.echo,
            n=n,
            grammar=self._grammar(fields),
            grammar_param="tools" if fields.tool_calling is not None else fields.grammar_param,
            presence_penalty=self._penalty(fields.presence_penalty, "presence_penalty"),
            frequency_penalty=self._penalty(fields.frequency_penalty, "frequency_penalty"),
            repetition_penalty=self._sampled(fields, "repetition_penalty", 1.0),
            logit_bias=self._logit_bias(fields.logit_bias),
            bad_words=bad_word_sequences(fields.bad_words, self._model.tokenizer),
            allowed_token_ids=allowed_token_ids(fields.allowed_token_ids, self._model.vocab_size, {
                "structured output or tools": fields.grammar is not None or fields.tool_calling is not None,
                "bad_words": bool(fields.bad_words), "min_tokens": bool(fields.min_tokens)}),
            tool_calling=fields.tool_calling,
            prediction_token_ids=self._prediction(fields.prediction),
        )

    def _prediction(self, text: str | None) -> tuple[int, ...]:
        """The predicted output's tokens, as the answer would spell them (no special tokens)."""
        if not text:
            return ()
        ids = self._model.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > MAX_PREDICTION_TOKENS:
            raise InvalidRequest(f"prediction has {len(ids)} tokens, more than the {MAX_PREDICTION_TOKENS} a draft "
                                 "copies from", param="prediction")
        return tuple(ids)

    def _logit_bias(self, bias: dict[int, float] | None) -> tuple[tuple[int, float], ...]:
        """(token id, bias) pairs in token id order; every id in the vocabulary, every bias in range."""
        vocab = self._model.vocab_size
        for token, value in (bias or {}).items():
            if not 0 <= token < vocab:
                raise InvalidRequest(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab})",
                                     param="logit_bias")
            if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
                raise InvalidRequest(f"logit_bias: the bias of token {token} must be between -{MAX_LOGIT_BIAS:g} and "
                                     f"{MAX_LOGIT_BIAS:g}, got {value}", param="logit_bias")
        return tuple(sorted((bias or {}).items()))

    @staticmethod
    def _penalty(value: float | None, name: str) -> float:
        value = 0.0 if value is None else value
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise InvalidRequest(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {value}",
                                 param=name)
        return value

    @staticmethod
    def _grammar(fields: RequestFields) -> Grammar | None:
        """The request's grammar, or its tool calls' (gateway.tools); the target compiles it (and refuses
        one that does not compile)."""
        grammar = fields.grammar if fields.tool_calling is None else fields.tool_calling.grammar()
        for name in ("ignore_eos", "min_tokens"):
            if grammar is not None and getattr(fields, name):
                raise InvalidRequest(f"{name} cannot be combined with structured output: the text ends when it is "
                                     "complete", param=name)
        if grammar is not None and fields.bad_words:
            raise InvalidRequest("bad_words cannot be combined with structured output or tools: the format may "
                                 "allow only a banned token where the text must go on", param="bad_words")
        if grammar is not None and len(grammar.spec) > MAX_GRAMMAR_CHARS:
            where = "response_format" if fields.tool_calling is None else "tools"
            raise InvalidRequest(f"{where}: the schema, regex or grammar has {len(grammar.spec)} characters, more "
                                 f"than the {MAX_GRAMMAR_CHARS} this server compiles", param=where)
        return grammar

    @staticmethod
    def _top_logprobs(top: int | None) -> int | None:
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", param="top_logprobs"
            )
        return top

    def check_model(self, model: str | None) -> None:
        if model and model != self._model.name:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {self._model.name!r}")

    def _sampled(self, fields: RequestFields, name: str, openai_default: float) -> float:
        """A sampling field's value (what the request sent, else the model's default, else OpenAI's),
        checked against the range a request may send (``gateway.sampling_defaults.RANGES``)."""
        value = _or(getattr(fields, name), getattr(self._defaults, name), openai_default)
        if not in_range(name, value):
            raise InvalidRequest(f"{name} must be {RANGES[name][1]}, got {value}", param=name)
        return value

    def _sampling(self, fields: RequestFields) -> SamplingParams:
        temperature, top_p = self._sampled(fields, "temperature", 1.0), self._sampled(fields, "top_p", 1.0)
        top_k, min_p = self._sampled(fields, "top_k", 0), self._sampled(fields, "min_p", 0.0)
        typical_p = self._sampled(fields, "typical_p", 1.0)
        if fields.seed is not None and not 0 <= fields.seed <= MAX_SEED:
            raise InvalidRequest(f"seed must be between 0 and 2**64-1, got {fields.seed}", param="seed")
        # top_k beyond the vocabulary truncates nothing; clamping keeps it within int32 on the wire.
        return SamplingParams(temperature, top_p, min(top_k, self._model.vocab_size), fields.seed, min_p, typical_p)

    @staticmethod
    def _speculation(fields: RequestFields) -> tuple[Speculation, int | None]:
        try:
            speculation = Speculation(fields.speculation or Speculation.AUTO.value)
        except ValueError:
            choices = ", ".join(repr(s.value) for s in Speculation)
            raise InvalidRequest(
                f"speculation must be one of {choices}, got {fields.speculation!r}", param="speculation"
            ) from None
        k = fields.num_speculative_tokens
        if k is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequest(
                f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {k}",
                param="num_speculative_tokens",
            )
        return speculation, k

    @staticmethod
    def _smoothing(value: str | None) -> Smoothing | None:
        if value is None:
            return None
        try:
            return Smoothing(value)
        except ValueError:
            choices = ", ".join(repr(s.value) for s in Smoothing)
            raise InvalidRequest(
                f"stream_smoothing must be one of {choices}, got {value!r}", param="stream_smoothing"
            ) from None

    @staticmethod
    def _stop(stop: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in stop):
            raise InvalidRequest("stop strings must not be empty", param="stop")
        return tuple(dict.fromkeys(stop))

    @staticmethod
    def _truncated(prompt_ids: list[int], keep: int | None) -> list[int]:
        """The prompt's last ``keep`` tokens (vLLM's ``truncate_prompt_tokens``; None: all of it)."""
        if keep is None:
            return prompt_ids
        if keep < 1:
            raise InvalidRequest(f"truncate_prompt_tokens must be at least 1 (the prompt's last tokens kept), got "
                                 f"{keep}", param="truncate_prompt_tokens")
        return prompt_ids[-keep:]

    def _stop_token_ids(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                                 param="stop_token_ids")
        vocab = self._model.vocab_size
        for token in ids:
            if not 0 <= token < vocab:
                raise InvalidRequest(f"stop_token_ids: token id {token} is outside the vocabulary [0, {vocab})",
                                     param="stop_token_ids")
        return tuple(dict.fromkeys(ids))

    def chat_prompt(self, messages: list[ChatMessage], options: TemplateOptions = TemplateOptions(),
                    calling: ToolCalling | None = None) -> list[int]:
        """The token ids a chat request prefills: its messages (with its tools, gateway.tools)
        through the model's chat template, as ``options`` ask."""
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        for i, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                raise InvalidRequest(
                    f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}",
                    param=f"messages[{i}].role",
                )
        options.check(messages, self._model.chat.reserved_names)
        try:
            return self._model.chat.token_ids(rendered(messages, calling, self._model.chat.uses_fallback), options)
        except ChatTemplateError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc

    def _completion_prompt(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:  # (requests reach validate one prompt at a time: prompt_batch)
                raise InvalidRequest(
                    f"prompt holds a batch of {len(prompt)} prompts; validate each (prompt_batch)", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must not be empty", param="prompt")
            return self._model.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        vocab = self._model.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:8]}", param="prompt"
            )
        return list(prompt)

    def _max_tokens(self, requested: int | None, default: int, prompt_len: int, param: str) -> int:
        context = self._model.max_context_len
        if prompt_len >= context:
            raise InvalidRequest(
                f"this model's maximum context length is {context} tokens, and the prompt has {prompt_len}: "
                "no room is left to generate; shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )
        room = context - prompt_len
        if requested is None:
            return min(default, room)
        if requested < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {requested}", param="max_tokens")
        if requested > room:
            raise InvalidRequest(
                f"this model's maximum context length is {context} tokens; you requested {prompt_len + requested} "
                f"({prompt_len} in the prompt, {requested} for the completion); reduce max_tokens or the prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested
