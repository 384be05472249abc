from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamSmoothing(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STREAM_SMOOTHING_UNSPECIFIED: _ClassVar[StreamSmoothing]
    STREAM_SMOOTHING_OFF: _ClassVar[StreamSmoothing]
    STREAM_SMOOTHING_AUTO: _ClassVar[StreamSmoothing]
STREAM_SMOOTHING_UNSPECIFIED: StreamSmoothing
STREAM_SMOOTHING_OFF: StreamSmoothing
STREAM_SMOOTHING_AUTO: StreamSmoothing

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GatewayServiceGenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_token_ids", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "speculation", "num_speculative_tokens", "ignore_eos", "stream_smoothing", "top_logprobs", "grammar", "presence_penalty", "frequency_penalty", "logit_bias", "prediction", "stop_token_ids", "include_stop_str_in_output", "min_tokens", "repetition_penalty", "truncate_prompt_tokens", "min_p", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "typical_p", "bad_words", "skip_special_tokens", "allowed_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STREAM_SMOOTHING_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculation: _common_pb2.SpeculationMode
    num_speculative_tokens: int
    ignore_eos: bool
    stream_smoothing: StreamSmoothing
    top_logprobs: int
    grammar: _common_pb2.Grammar
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    prediction: str
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    min_tokens: int
    repetition_penalty: float
    truncate_prompt_tokens: int
    min_p: float
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: _struct_pb2.Struct
    typical_p: float
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    skip_special_tokens: bool
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationMode, str]] = ..., num_speculative_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stream_smoothing: _Optional[_Union[StreamSmoothing, str]] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prediction: _Optional[str] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., truncate_prompt_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., typical_p: _Optional[float] = ..., bad_words: _Optional[_Iterable[str]] = ..., skip_special_tokens: _Optional[bool] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculativeDecodingStats(_message.Message):
    __slots__ = ("rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "mode", "fallbacks", "fallback_reason", "empty_rounds")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    EMPTY_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mode: str
    fallbacks: int
    fallback_reason: str
    empty_rounds: int
    def __init__(self, rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mode: _Optional[str] = ..., fallbacks: _Optional[int] = ..., fallback_reason: _Optional[str] = ..., empty_rounds: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "speculative_decoding", "cached_prompt_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_DECODING_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative_decoding: SpeculativeDecodingStats
    cached_prompt_tokens: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., speculative_decoding: _Optional[_Union[SpeculativeDecodingStats, _Mapping]] = ..., cached_prompt_tokens: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class GatewayServiceGenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GatewayServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GatewayServiceInfoResponse(_message.Message):
    __slots__ = ("model", "draft", "num_speculative_tokens", "max_context_len")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    draft: str
    num_speculative_tokens: int
    max_context_len: int
    def __init__(self, model: _Optional[str] = ..., draft: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., max_context_len: _Optional[int] = ...) -> None: ...
