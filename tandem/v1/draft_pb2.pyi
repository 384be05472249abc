from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftServiceInfoResponse(_message.Message):
    __slots__ = ("proposer", "model_name", "tokenizer_fingerprint", "num_speculative_tokens", "target_model_name", "active_sessions")
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    proposer: str
    model_name: str
    tokenizer_fingerprint: str
    num_speculative_tokens: int
    target_model_name: str
    active_sessions: int
    def __init__(self, proposer: _Optional[str] = ..., model_name: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., target_model_name: _Optional[str] = ..., active_sessions: _Optional[int] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "prompt_len", "params", "num_speculative_tokens", "tokenizer_fingerprint", "max_new_tokens", "target_address", "prediction_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    params: _common_pb2.SessionParams
    num_speculative_tokens: int
    tokenizer_fingerprint: str
    max_new_tokens: int
    target_address: str
    prediction_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.SessionParams, _Mapping]] = ..., num_speculative_tokens: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., target_address: _Optional[str] = ..., prediction_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("token_ids", "committed_len", "finish_reason", "num_draft_tokens", "num_accepted", "round_seconds", "verify_seconds", "num_draft_positions", "step_seconds", "logprobs", "num_prediction_drafts", "num_prediction_accepted")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREDICTION_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREDICTION_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed_len: int
    finish_reason: _common_pb2.FinishReason
    num_draft_tokens: int
    num_accepted: int
    round_seconds: float
    verify_seconds: float
    num_draft_positions: int
    step_seconds: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    num_prediction_drafts: int
    num_prediction_accepted: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., committed_len: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted: _Optional[int] = ..., round_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., num_draft_positions: _Optional[int] = ..., step_seconds: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., num_prediction_drafts: _Optional[int] = ..., num_prediction_accepted: _Optional[int] = ...) -> None: ...
