"""Protobuf <-> plain-value conversion for the gateway's upstream calls.

The only module of the gateway that builds or reads ``tandem.v1`` upstream messages (besides the
gRPC plumbing of ``upstream.py``, whose client signatures carry them, and the gateway's own
``GatewayService`` edge in ``grpc_server.py``). The session code hands these functions plain
values (:mod:`gateway.types`) and passes what they return to the upstream clients untouched.

Invariant: a message built here carries exactly the fields the plain values say, and a message
read here loses nothing the session code uses.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.policy import Mode
from gateway.types import Batch, FinishReason, SessionParams
from tandem.rpc import codecs
from tandem.v1 import common_pb2, draft_pb2, target_pb2

# -- requests ----------------------------------------------------------------------------------


def prefill_request(
    session_id: str,
    token_ids: Sequence[int],
    params: SessionParams,
    tokenizer_fingerprint: str,
    prompt_logprobs: bool = False,
) -> target_pb2.PrefillRequest:
    return target_pb2.PrefillRequest(
        session_id=session_id,
        prompt_token_ids=token_ids,
        params=codecs.session_params_to_wire(params),
        tokenizer_fingerprint=tokenizer_fingerprint,
        prompt_logprobs=prompt_logprobs,
    )


def generate_request(session_id: str, max_new_tokens: int) -> target_pb2.TargetServiceGenerateRequest:
    return target_pb2.TargetServiceGenerateRequest(session_id=session_id, max_new_tokens=max_new_tokens)


def speculate_request(
    *,
    session_id: str,
    token_ids: Sequence[int],
    prompt_len: int,
    params: SessionParams,
    num_speculative_tokens: int,
    tokenizer_fingerprint: str,
    max_new_tokens: int,
    target_address: str = "",
    prediction_token_ids: Sequence[int] = (),
) -> draft_pb2.SpeculateRequest:
    return draft_pb2.SpeculateRequest(
        session_id=session_id,
        target_address=target_address,
        token_ids=token_ids,
        prompt_len=prompt_len,
        params=codecs.session_params_to_wire(params),
        num_speculative_tokens=num_speculative_tokens,
        tokenizer_fingerprint=tokenizer_fingerprint,
        max_new_tokens=max_new_tokens,
        prediction_token_ids=prediction_token_ids,
    )


# -- responses ---------------------------------------------------------------------------------


def finish_from_wire(number: int) -> FinishReason:
    """The plain finish reason of a ``tandem.v1.FinishReason`` number. Every number tandem.v1
    defines has one; any other raises protobuf's ``ValueError`` for an undefined enum value."""
    common_pb2.FinishReason.Name(number)  # raises ValueError for a number tandem.v1 does not define
    return codecs.finish_reason(number)


def finish_name(reason: FinishReason) -> str:
    """The wire name of a finish reason (e.g. ``FINISH_REASON_CANCELLED``), as error messages quote it."""
    return common_pb2.FinishReason.Name(codecs.finish_reason_to_wire(reason))


def batch_from_prefill(response: target_pb2.PrefillResponse, mode: Mode | None = None) -> Batch:
    """The first token of a target session; ``mode`` None for the request's first token."""
    logprobs = codecs.token_logprobs([response.logprobs]) if response.HasField("logprobs") else ()
    return Batch(
        (response.token_id,), finish_from_wire(response.finish_reason), response.committed_len, mode,
        logprobs=logprobs, cached_tokens=response.cached_tokens,
        prompt_logprobs=codecs.token_logprobs(response.prompt_logprobs),
    )


def batch_from_generate(response: target_pb2.TargetServiceGenerateResponse) -> Batch:
    return Batch(
        tuple(response.token_ids), finish_from_wire(response.finish_reason), response.committed_len,
        Mode.AUTOREGRESSIVE, step_seconds=response.step_seconds, pass_seconds=response.pass_seconds,
        logprobs=codecs.token_logprobs(response.logprobs),
    )


def batch_from_speculate(response: draft_pb2.SpeculateResponse) -> Batch:
    return Batch(
        tuple(response.token_ids),
        finish_from_wire(response.finish_reason),
        response.committed_len,
        Mode.SPECULATIVE,
        num_draft_tokens=response.num_draft_tokens,
        num_accepted=response.num_accepted,
        num_draft_positions=response.num_draft_positions,
        verify_seconds=response.verify_seconds,
        step_seconds=response.step_seconds,
        logprobs=codecs.token_logprobs(response.logprobs),
        num_prediction_drafts=response.num_prediction_drafts,
        num_prediction_accepted=response.num_prediction_accepted,
    )
