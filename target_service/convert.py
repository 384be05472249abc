"""Translation between ``tandem.v1`` messages and the engine's dataclasses (``api.py``)."""

from __future__ import annotations

import torch

from tandem.v1 import common_pb2, target_pb2
from target_service.api import DraftBlock, EngineInfo, GenerateResult, PrefillResult, SparseQ, Verdict
from target_service.session import SessionConfig


def session_config(params: common_pb2.SessionParams, return_hidden_states: bool) -> SessionConfig:
    sampling = params.sampling
    return SessionConfig(
        max_new_tokens=params.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed if sampling.HasField("seed") else None,
        ignore_eos=params.ignore_eos,
        stop_token_ids=tuple(params.stop_token_ids),
        return_hidden_states=return_hidden_states,
    )


def draft_block(request: target_pb2.VerifyRequest) -> DraftBlock:
    return DraftBlock(
        session_id=request.session_id,
        base_len=request.base_len,
        draft_token_ids=tuple(request.draft_token_ids),
        assumed_token_ids=tuple(request.assumed_token_ids),
        draft_probs=tuple(SparseQ(tuple(q.token_ids), tuple(q.probs)) for q in request.draft_probs),
        block_id=request.block_id,
        tokenizer_fingerprint=request.tokenizer_fingerprint,
        return_hidden_states=request.return_hidden_states,
        draft_parents=tuple(request.draft_parents),
    )


def hidden_states(tensor: torch.Tensor | None) -> common_pb2.HiddenStates | None:
    """``[positions, hidden_size]`` as little-endian float16 bytes (None stays None)."""
    if tensor is None:
        return None
    half = tensor.detach().to(device="cpu", dtype=torch.float16).contiguous()
    data = half.numpy().astype("<f2", copy=False).tobytes()
    return common_pb2.HiddenStates(data=data, shape=list(half.shape), dtype="float16")


def prefill_response(result: PrefillResult) -> target_pb2.PrefillResponse:
    return target_pb2.PrefillResponse(
        token_id=result.token_id,
        committed_len=result.committed_len,
        finish_reason=result.finish_reason,
        hidden_states=hidden_states(result.hidden_states),
    )


def verify_response(verdict: Verdict) -> target_pb2.VerifyResponse:
    return target_pb2.VerifyResponse(
        block_id=verdict.block_id,
        status=verdict.status,
        num_accepted=verdict.num_accepted,
        committed_token_ids=verdict.committed_token_ids,
        committed_len=verdict.committed_len,
        finish_reason=verdict.finish_reason,
        hidden_states=hidden_states(verdict.hidden_states),
        verify_seconds=verdict.verify_seconds,
    )


def generate_response(result: GenerateResult) -> target_pb2.TargetServiceGenerateResponse:
    return target_pb2.TargetServiceGenerateResponse(
        token_ids=result.token_ids, committed_len=result.committed_len, finish_reason=result.finish_reason
    )


def info_response(info: EngineInfo) -> target_pb2.TargetServiceInfoResponse:
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
    )
