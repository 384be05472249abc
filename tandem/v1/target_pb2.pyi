from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerdictStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_STATUS_UNSPECIFIED: _ClassVar[VerdictStatus]
    VERDICT_STATUS_OK: _ClassVar[VerdictStatus]
    VERDICT_STATUS_STALE: _ClassVar[VerdictStatus]
    VERDICT_STATUS_FINISHED: _ClassVar[VerdictStatus]
VERDICT_STATUS_UNSPECIFIED: VerdictStatus
VERDICT_STATUS_OK: VerdictStatus
VERDICT_STATUS_STALE: VerdictStatus
VERDICT_STATUS_FINISHED: VerdictStatus

class TargetServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetServiceInfoResponse(_message.Message):
    __slots__ = ("model_name", "vocab_size", "tokenizer_fingerprint", "dtype", "device", "max_context_len", "eos_token_ids", "hidden_size", "verifier_backend", "active_sessions", "kv_free_tokens", "kv_capacity_tokens", "queued_passes")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PASSES_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    dtype: str
    device: str
    max_context_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    verifier_backend: str
    active_sessions: int
    kv_free_tokens: int
    kv_capacity_tokens: int
    queued_passes: int
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_context_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., verifier_backend: _Optional[str] = ..., active_sessions: _Optional[int] = ..., kv_free_tokens: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., queued_passes: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "params", "tokenizer_fingerprint", "return_hidden_states", "prompt_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SessionParams
    tokenizer_fingerprint: str
    return_hidden_states: bool
    prompt_logprobs: bool
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SessionParams, _Mapping]] = ..., tokenizer_fingerprint: _Optional[str] = ..., return_hidden_states: _Optional[bool] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("token_id", "committed_len", "finish_reason", "hidden_states", "logprobs", "cached_tokens", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    committed_len: int
    finish_reason: _common_pb2.FinishReason
    hidden_states: _common_pb2.HiddenStates
    logprobs: _common_pb2.TokenLogprobs
    cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_id: _Optional[int] = ..., committed_len: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., hidden_states: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "base_len", "assumed_token_ids", "draft_token_ids", "draft_probs", "block_id", "tokenizer_fingerprint", "return_hidden_states", "draft_parents")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_len: int
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    block_id: int
    tokenizer_fingerprint: str
    return_hidden_states: bool
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., base_len: _Optional[int] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., block_id: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., return_hidden_states: _Optional[bool] = ..., draft_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("block_id", "status", "num_accepted", "committed_token_ids", "committed_len", "finish_reason", "hidden_states", "verify_seconds", "pass_rows", "pass_tokens", "step_seconds", "logprobs")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASS_ROWS_FIELD_NUMBER: _ClassVar[int]
    PASS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    status: VerdictStatus
    num_accepted: int
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed_len: int
    finish_reason: _common_pb2.FinishReason
    hidden_states: _common_pb2.HiddenStates
    verify_seconds: float
    pass_rows: int
    pass_tokens: int
    step_seconds: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, block_id: _Optional[int] = ..., status: _Optional[_Union[VerdictStatus, str]] = ..., num_accepted: _Optional[int] = ..., committed_token_ids: _Optional[_Iterable[int]] = ..., committed_len: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., hidden_states: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ..., verify_seconds: _Optional[float] = ..., pass_rows: _Optional[int] = ..., pass_tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TargetServiceGenerateRequest(_message.Message):
    __slots__ = ("session_id", "max_new_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_new_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class TargetServiceGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "committed_len", "finish_reason", "pass_seconds", "step_seconds", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PASS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed_len: int
    finish_reason: _common_pb2.FinishReason
    pass_seconds: float
    step_seconds: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., committed_len: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., pass_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
