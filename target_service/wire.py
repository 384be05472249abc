"""Translation between ``tandem.v1`` messages and the engine's dataclasses (``types.py``); what the
target shares with the draft and the gateway goes through ``tandem.rpc.codecs``."""

from __future__ import annotations

from tandem.rpc import codecs
from tandem.v1 import common_pb2, target_pb2
from target_service.errors import InvalidArgument
from target_service.session import SessionConfig
from target_service.types import DraftBlock, EngineInfo, GenerateResult, PrefillResult, TargetLoad, Verdict


def session_config(params: common_pb2.SessionParams, return_hidden_states: bool) -> SessionConfig:
    try:
        return SessionConfig.of(codecs.session_params(params), return_hidden_states)
    except codecs.WireError as error:
        raise InvalidArgument(str(error)) from error


def draft_block(request: target_pb2.VerifyRequest) -> DraftBlock:
    return codecs.draft_block(request)


def prefill_response(result: PrefillResult) -> target_pb2.PrefillResponse:
    return target_pb2.PrefillResponse(
        token_id=result.token_id,
        committed_len=result.committed_len,
        finish_reason=codecs.finish_reason_to_wire(result.finish_reason),
        hidden_states=codecs.hidden_states_to_wire(result.hidden_states),
        logprobs=codecs.token_logprobs_to_wire([result.logprobs])[0] if result.logprobs else None,
        cached_tokens=result.cached_tokens,
        prompt_logprobs=codecs.token_logprobs_to_wire(result.prompt_logprobs),
    )


def verify_response(verdict: Verdict) -> target_pb2.VerifyResponse:
    return codecs.verdict_to_wire(verdict)


def generate_response(result: GenerateResult) -> target_pb2.TargetServiceGenerateResponse:
    return target_pb2.TargetServiceGenerateResponse(
        token_ids=result.token_ids,
        committed_len=result.committed_len,
        finish_reason=codecs.finish_reason_to_wire(result.finish_reason),
        pass_seconds=result.pass_seconds,
        step_seconds=result.step_seconds,
        logprobs=codecs.token_logprobs_to_wire(result.logprobs),
    )


def info_response(info: EngineInfo, load: TargetLoad) -> target_pb2.TargetServiceInfoResponse:
    return target_pb2.TargetServiceInfoResponse(
        model_name=info.model_name,
        vocab_size=info.vocab_size,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        dtype=info.dtype,
        device=info.device,
        max_context_len=info.max_context_len,
        eos_token_ids=info.eos_token_ids,
        hidden_size=info.hidden_size,
        verifier_backend=info.verifier_backend,
        active_sessions=load.active_sessions,
        kv_free_tokens=load.kv_free_tokens,
        kv_capacity_tokens=load.kv_capacity_tokens,
        queued_passes=load.queued_passes,
    )
