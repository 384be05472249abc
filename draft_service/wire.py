"""Protobuf <-> dataclass conversion: the only module of the draft service that reads or builds
``tandem.v1`` messages (besides the gRPC plumbing in ``server.py`` and ``target_client.py``). What
the draft shares with the target and the gateway is converted by ``tandem.rpc.codecs``."""

from __future__ import annotations

import torch

from draft_service.errors import ProtocolError
from draft_service.types import LogitShaping, ProposedBlock, RoundResult, SessionSpec, TargetInfo, Verdict
from tandem.rpc import codecs
from tandem.rpc.types import Grammar
from tandem.v1 import common_pb2, draft_pb2, target_pb2


def spec_from_request(request: draft_pb2.SpeculateRequest, default_k: int) -> SessionSpec:
    """Reads a Speculate request as is (``validation.validate_spec`` judges it); K 0 = default."""
    params = request.params
    return SessionSpec(
        session_id=request.session_id,
        token_ids=tuple(request.token_ids),
        prompt_len=request.prompt_len,
        sampling=codecs.sampling_params(params.sampling),
        num_speculative_tokens=request.num_speculative_tokens or default_k,
        session_max_new_tokens=params.max_new_tokens,
        max_new_tokens=request.max_new_tokens,
        tokenizer_fingerprint=request.tokenizer_fingerprint,
        target_address=request.target_address,
        grammar=_grammar(params),
        continued_tokens=params.continued_tokens,
        prediction_token_ids=tuple(request.prediction_token_ids),
        shaping=_shaping(request),
    )


def _shaping(request: draft_pb2.SpeculateRequest) -> LogitShaping | None:
    """The target's penalties and bias for the session, which its head follows; None: none."""
    params = request.params
    shaping = LogitShaping(params.presence_penalty, params.frequency_penalty, params.repetition_penalty or 1.0,
                           tuple(sorted(params.logit_bias.items())), request.prompt_len - params.continued_tokens)
    return shaping if shaping.active else None


def _grammar(params: common_pb2.SessionParams) -> Grammar | None:
    """The session's grammar; one this build cannot read is left unguided (the target, which
    holds the session, has judged it already)."""
    if not params.HasField("grammar"):
        return None
    try:
        return codecs.grammar(params.grammar)
    except codecs.WireError:
        return None


def speculate_response(result: RoundResult) -> draft_pb2.SpeculateResponse:
    return draft_pb2.SpeculateResponse(
        token_ids=result.token_ids,
        committed_len=result.committed_len,
        finish_reason=codecs.finish_reason_to_wire(result.finish_reason),
        num_draft_tokens=result.num_draft_tokens,
        num_accepted=result.num_accepted,
        round_seconds=result.round_seconds,
        verify_seconds=result.verify_seconds,
        num_draft_positions=result.num_draft_positions,
        step_seconds=result.step_seconds,
        logprobs=codecs.token_logprobs_to_wire(result.logprobs),
        num_prediction_drafts=result.num_prediction_drafts,
        num_prediction_accepted=result.num_prediction_accepted,
    )


def verify_request(block: ProposedBlock) -> target_pb2.VerifyRequest:
    return codecs.draft_block_to_wire(block.block())


def verdict_from_response(response: target_pb2.VerifyResponse) -> Verdict:
    try:
        return codecs.verdict(response)
    except codecs.WireError as error:
        raise ProtocolError(str(error)) from error


def hidden_states(message: common_pb2.HiddenStates) -> torch.Tensor:
    """A ``HiddenStates`` message as a float32 tensor of its shape (e.g. [positions, hidden])."""
    try:
        return codecs.hidden_states(message)
    except codecs.WireError as error:
        raise ProtocolError(str(error)) from error


def target_info_from_response(response: target_pb2.TargetServiceInfoResponse) -> TargetInfo:
    return TargetInfo(
        model_name=response.model_name,
        vocab_size=response.vocab_size,
        tokenizer_fingerprint=response.tokenizer_fingerprint,
        max_context_len=response.max_context_len,
        eos_token_ids=tuple(response.eos_token_ids),
        hidden_size=response.hidden_size,
    )
