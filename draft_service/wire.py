"""Protobuf <-> dataclass conversion: the only module of the draft service that reads or builds
``tandem.v1`` messages (besides the gRPC plumbing in ``server.py`` and ``target_client.py``)."""

from __future__ import annotations

import math

import numpy as np
import torch

from draft_service.errors import ProtocolError
from draft_service.types import (
    DraftBlock,
    FinishReason,
    RoundResult,
    SamplingConfig,
    SessionSpec,
    TargetInfo,
    Verdict,
    VerdictStatus,
)
from tandem.v1 import common_pb2, draft_pb2, target_pb2

_FINISH_FROM_WIRE = {
    common_pb2.FINISH_REASON_UNSPECIFIED: FinishReason.NONE,
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
}
_FINISH_TO_WIRE = {reason: number for number, reason in _FINISH_FROM_WIRE.items()}
_STATUS_FROM_WIRE = {
    target_pb2.VERDICT_STATUS_OK: VerdictStatus.OK,
    target_pb2.VERDICT_STATUS_STALE: VerdictStatus.STALE,
    target_pb2.VERDICT_STATUS_FINISHED: VerdictStatus.FINISHED,
}


def spec_from_request(request: draft_pb2.SpeculateRequest, default_k: int) -> SessionSpec:
    """Reads a Speculate request as is (``validation.validate_spec`` judges it); K 0 = default."""
    params = request.params
    sampling = params.sampling
    return SessionSpec(
        session_id=request.session_id,
        token_ids=tuple(request.token_ids),
        prompt_len=request.prompt_len,
        sampling=SamplingConfig(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed if sampling.HasField("seed") else None,
        ),
        num_speculative_tokens=request.num_speculative_tokens or default_k,
        session_max_new_tokens=params.max_new_tokens,
        max_new_tokens=request.max_new_tokens,
        tokenizer_fingerprint=request.tokenizer_fingerprint,
    )


def speculate_response(result: RoundResult) -> draft_pb2.SpeculateResponse:
    return draft_pb2.SpeculateResponse(
        token_ids=result.token_ids,
        committed_len=result.committed_len,
        finish_reason=_FINISH_TO_WIRE[result.finish_reason],
        num_draft_tokens=result.num_draft_tokens,
        num_accepted=result.num_accepted,
        round_seconds=result.round_seconds,
        verify_seconds=result.verify_seconds,
        num_draft_positions=result.num_draft_positions,
    )


def verify_request(block: DraftBlock) -> target_pb2.VerifyRequest:
    proposal = block.proposal
    return target_pb2.VerifyRequest(
        session_id=block.session_id,
        base_len=block.base_len,
        draft_token_ids=proposal.token_ids,
        draft_probs=[
            common_pb2.SparseDistribution(token_ids=dist.token_ids, probs=dist.probs) for dist in proposal.probs
        ],
        block_id=block.block_id,
        tokenizer_fingerprint=block.tokenizer_fingerprint,
        return_hidden_states=block.return_hidden_states,
        draft_parents=proposal.parents,
    )


def verdict_from_response(response: target_pb2.VerifyResponse) -> Verdict:
    status = _STATUS_FROM_WIRE.get(response.status)
    if status is None:
        raise ProtocolError(f"verdict for block {response.block_id} has no valid status ({response.status})")
    return Verdict(
        block_id=response.block_id,
        status=status,
        num_accepted=response.num_accepted,
        committed_token_ids=tuple(response.committed_token_ids),
        committed_len=response.committed_len,
        finish_reason=_FINISH_FROM_WIRE.get(response.finish_reason, FinishReason.NONE),
        verify_seconds=response.verify_seconds,
        hidden_states=hidden_states(response.hidden_states) if response.HasField("hidden_states") else None,
    )


_HIDDEN_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def hidden_states(message: common_pb2.HiddenStates) -> torch.Tensor:
    """A ``HiddenStates`` message as a float32 tensor of its shape (e.g. [positions, hidden])."""
    dtype = _HIDDEN_DTYPES.get(message.dtype)
    if dtype is None:
        raise ProtocolError(f"hidden states have dtype {message.dtype!r}; expected one of {sorted(_HIDDEN_DTYPES)}")
    shape = tuple(message.shape)
    if any(d < 0 for d in shape) or len(message.data) != 2 * math.prod(shape):
        raise ProtocolError(f"hidden states of shape {list(shape)} come with {len(message.data)} bytes")
    # Little-endian 16-bit words on the wire -> native order (a copy, so torch gets a writable
    # buffer), then reinterpreted as the float type.
    words = np.frombuffer(message.data, dtype="<u2").astype(np.uint16).view(np.int16)  # [prod(shape)]
    return torch.from_numpy(words).view(dtype).reshape(shape).float()


def target_info_from_response(response: target_pb2.TargetServiceInfoResponse) -> TargetInfo:
    return TargetInfo(
        model_name=response.model_name,
        vocab_size=response.vocab_size,
        tokenizer_fingerprint=response.tokenizer_fingerprint,
        max_context_len=response.max_context_len,
        eos_token_ids=tuple(response.eos_token_ids),
        hidden_size=response.hidden_size,
    )
