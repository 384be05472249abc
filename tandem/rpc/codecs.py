"""``tandem.v1`` messages to and from :mod:`tandem.rpc.types`: the conversions the services share.

Each service's own edge module (``draft_service/wire.py``, ``target_service/wire.py``,
``gateway/wire.py``) builds its RPC messages with these, so an enum's numbering, a field's presence
and the hidden states' byte layout are written down once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from tandem.rpc.types import (
    DraftBlock,
    FinishReason,
    Grammar,
    GrammarKind,
    SamplingParams,
    SessionParams,
    SparseDist,
    TokenLogprob,
    Verdict,
    VerdictStatus,
)
from tandem.v1 import common_pb2, target_pb2


class WireError(ValueError):
    """A message that cannot be read as what it claims to be (the caller maps it to its status)."""


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
_STATUS_TO_WIRE = {status: number for number, status in _STATUS_FROM_WIRE.items()}


def finish_reason(number: int) -> FinishReason:
    """A wire finish reason; numbers this build does not know read as not finished."""
    return _FINISH_FROM_WIRE.get(number, FinishReason.NONE)


def finish_reason_to_wire(reason: FinishReason) -> int:
    return _FINISH_TO_WIRE[reason]


def verdict_status(number: int) -> VerdictStatus | None:
    """A wire verdict status; None for UNSPECIFIED or a number this build does not know."""
    return _STATUS_FROM_WIRE.get(number)


def verdict_status_to_wire(status: VerdictStatus) -> int:
    return _STATUS_TO_WIRE[status]


def sampling_params(message: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        min_p=message.min_p,
        typical_p=message.typical_p,
    )


def sampling_params_to_wire(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed, min_p=params.min_p,
        typical_p=params.typical_p,
    )


def session_params(message: common_pb2.SessionParams) -> SessionParams:
    return SessionParams(
        sampling=sampling_params(message.sampling),
        max_new_tokens=message.max_new_tokens,
        ignore_eos=message.ignore_eos,
        stop_token_ids=tuple(message.stop_token_ids),
        top_logprobs=message.top_logprobs if message.HasField("top_logprobs") else None,
        grammar=grammar(message.grammar) if message.HasField("grammar") else None,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        continued_tokens=message.continued_tokens,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        min_tokens=message.min_tokens,
        repetition_penalty=message.repetition_penalty or 1.0,  # unset on the wire: none
        bad_words=tuple(tuple(s.token_ids) for s in message.bad_words),
        allowed_token_ids=tuple(message.allowed_token_ids),
    )


def session_params_to_wire(params: SessionParams) -> common_pb2.SessionParams:
    return common_pb2.SessionParams(
        sampling=sampling_params_to_wire(params.sampling),
        max_new_tokens=params.max_new_tokens,
        ignore_eos=params.ignore_eos,
        stop_token_ids=params.stop_token_ids,
        top_logprobs=params.top_logprobs,
        grammar=None if params.grammar is None else grammar_to_wire(params.grammar),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        continued_tokens=params.continued_tokens,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
        repetition_penalty=params.repetition_penalty,
        bad_words=[common_pb2.TokenSequence(token_ids=s) for s in params.bad_words],
        allowed_token_ids=params.allowed_token_ids,
    )


_GRAMMAR_KIND_TO_WIRE = {
    GrammarKind.JSON_SCHEMA: common_pb2.GRAMMAR_KIND_JSON_SCHEMA,
    GrammarKind.REGEX: common_pb2.GRAMMAR_KIND_REGEX,
    GrammarKind.EBNF: common_pb2.GRAMMAR_KIND_EBNF,
}
_GRAMMAR_KIND_FROM_WIRE = {wire: kind for kind, wire in _GRAMMAR_KIND_TO_WIRE.items()}


def grammar(message: common_pb2.Grammar) -> Grammar:
    """A grammar from the wire; an unset or unknown kind is refused (a caller that asked for a
    constraint this build does not know must not get free text)."""
    kind = _GRAMMAR_KIND_FROM_WIRE.get(message.kind)
    if kind is None:
        raise WireError(f"grammar kind {message.kind} is not one this server knows (json_schema, regex, ebnf)")
    return Grammar(kind, message.spec)


def grammar_to_wire(value: Grammar) -> common_pb2.Grammar:
    return common_pb2.Grammar(kind=_GRAMMAR_KIND_TO_WIRE[value.kind], spec=value.spec)


def token_logprobs(messages: Iterable[common_pb2.TokenLogprobs]) -> tuple[TokenLogprob, ...]:
    """Log-probabilities as sent; a message whose alternatives and their values differ in number
    cannot be read as one."""
    found = []
    for m in messages:
        if len(m.top_token_ids) != len(m.top_logprobs):
            raise WireError(
                f"token log-probabilities name {len(m.top_token_ids)} alternatives with {len(m.top_logprobs)} values"
            )
        found.append(TokenLogprob(m.logprob, tuple(m.top_token_ids), tuple(m.top_logprobs)))
    return tuple(found)


def token_logprobs_to_wire(logprobs: Iterable[TokenLogprob]) -> list[common_pb2.TokenLogprobs]:
    return [
        common_pb2.TokenLogprobs(logprob=lp.logprob, top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs)
        for lp in logprobs
    ]


def sparse_dists(messages: list[common_pb2.SparseDistribution]) -> tuple[SparseDist, ...]:
    return tuple(SparseDist(tuple(q.token_ids), tuple(q.probs)) for q in messages)


def sparse_dists_to_wire(dists: tuple[SparseDist, ...]) -> list[common_pb2.SparseDistribution]:
    return [common_pb2.SparseDistribution(token_ids=q.token_ids, probs=q.probs) for q in dists]


_HIDDEN_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def hidden_states(message: common_pb2.HiddenStates) -> torch.Tensor:
    """A ``HiddenStates`` message as a float32 tensor of its shape (e.g. [positions, hidden])."""
    dtype = _HIDDEN_DTYPES.get(message.dtype)
    if dtype is None:
        raise WireError(f"hidden states have dtype {message.dtype!r}; expected one of {sorted(_HIDDEN_DTYPES)}")
    shape = tuple(message.shape)
    if any(d < 0 for d in shape) or len(message.data) != 2 * math.prod(shape):
        raise WireError(f"hidden states of shape {list(shape)} come with {len(message.data)} bytes")
    # Little-endian 16-bit words on the wire -> native order (a copy, so torch gets a writable
    # buffer), then reinterpreted as the float type.
    words = np.frombuffer(message.data, dtype="<u2").astype(np.uint16).view(np.int16)  # [prod(shape)]
    return torch.from_numpy(words).view(dtype).reshape(shape).float()


def hidden_states_to_wire(tensor: torch.Tensor | None) -> common_pb2.HiddenStates | None:
    """``[positions, hidden_size]`` as little-endian float16 bytes (None stays None)."""
    if tensor is None:
        return None
    half = tensor.detach().to(device="cpu", dtype=torch.float16).contiguous()
    data = half.numpy().astype("<f2", copy=False).tobytes()
    return common_pb2.HiddenStates(data=data, shape=list(half.shape), dtype="float16")


def draft_block(request: target_pb2.VerifyRequest) -> DraftBlock:
    """A Verify request as is (the target's validation judges it)."""
    return DraftBlock(
        session_id=request.session_id,
        base_len=request.base_len,
        draft_token_ids=tuple(request.draft_token_ids),
        assumed_token_ids=tuple(request.assumed_token_ids),
        draft_probs=sparse_dists(request.draft_probs),
        block_id=request.block_id,
        tokenizer_fingerprint=request.tokenizer_fingerprint,
        return_hidden_states=request.return_hidden_states,
        draft_parents=tuple(request.draft_parents),
    )


def draft_block_to_wire(block: DraftBlock) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(
        session_id=block.session_id,
        base_len=block.base_len,
        assumed_token_ids=block.assumed_token_ids,
        draft_token_ids=block.draft_token_ids,
        draft_probs=sparse_dists_to_wire(block.draft_probs),
        block_id=block.block_id,
        tokenizer_fingerprint=block.tokenizer_fingerprint,
        return_hidden_states=block.return_hidden_states,
        draft_parents=block.draft_parents,
    )


def verdict(response: target_pb2.VerifyResponse) -> Verdict:
    status = verdict_status(response.status)
    if status is None:
        raise WireError(f"verdict for block {response.block_id} has no valid status ({response.status})")
    return Verdict(
        block_id=response.block_id,
        status=status,
        committed_len=response.committed_len,
        num_accepted=response.num_accepted,
        committed_token_ids=tuple(response.committed_token_ids),
        finish_reason=finish_reason(response.finish_reason),
        hidden_states=hidden_states(response.hidden_states) if response.HasField("hidden_states") else None,
        verify_seconds=response.verify_seconds,
        pass_rows=response.pass_rows,
        pass_tokens=response.pass_tokens,
        step_seconds=response.step_seconds,
        logprobs=token_logprobs(response.logprobs),
    )


def verdict_to_wire(verdict: Verdict) -> target_pb2.VerifyResponse:
    return target_pb2.VerifyResponse(
        block_id=verdict.block_id,
        status=verdict_status_to_wire(verdict.status),
        num_accepted=verdict.num_accepted,
        committed_token_ids=verdict.committed_token_ids,
        committed_len=verdict.committed_len,
        finish_reason=finish_reason_to_wire(verdict.finish_reason),
        hidden_states=hidden_states_to_wire(verdict.hidden_states),
        verify_seconds=verdict.verify_seconds,
        pass_rows=verdict.pass_rows,
        pass_tokens=verdict.pass_tokens,
        step_seconds=verdict.step_seconds,
        logprobs=token_logprobs_to_wire(verdict.logprobs),
    )
