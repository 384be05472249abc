"""Checks a Speculate request before any state is created, so bad input costs nothing and gets
one clear INVALID_ARGUMENT message naming the field."""

from __future__ import annotations

import math

from draft_service.errors import InvalidRequestError
from draft_service.types import SessionSpec, TargetInfo
from tandem.rpc import addresses
from tandem.rpc.types import MAX_PREDICTION_TOKENS

MAX_SPECULATIVE_TOKENS = 64
MAX_SESSION_ID_LEN = 256
MAX_ADDRESS_LEN = 300  # a DNS name (253) and a port, with room to spare


def validate_spec(spec: SessionSpec, target: TargetInfo) -> None:
    """Raises InvalidRequestError for the first problem found. Only the form of ``target_address``
    is checked here; whether it is one of the draft's targets is the router's to say
    (``targets.TargetRouter.client``, which may have to resolve the pool again)."""
    problem = _first_problem(spec, target)
    if problem:
        raise InvalidRequestError(problem)


def _first_problem(spec: SessionSpec, target: TargetInfo) -> str | None:
    if not spec.session_id:
        return "session_id must not be empty"
    if len(spec.session_id) > MAX_SESSION_ID_LEN:
        return f"session_id is longer than {MAX_SESSION_ID_LEN} characters"
    if not spec.token_ids:
        return "token_ids must not be empty (the prompt and the tokens committed so far)"
    low, high = min(spec.token_ids), max(spec.token_ids)
    if low < 0 or (target.vocab_size and high >= target.vocab_size):
        bad = low if low < 0 else high
        return f"token_ids contain {bad}, outside the target vocabulary [0, {target.vocab_size})"
    if not 1 <= spec.prompt_len <= len(spec.token_ids):
        return f"prompt_len must be in [1, {len(spec.token_ids)}] (len(token_ids)), got {spec.prompt_len}"
    if not 1 <= spec.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        return (
            f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] (0 = the service default), "
            f"got {spec.num_speculative_tokens}"
        )
    sampling = spec.sampling
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        return f"temperature must be a finite number >= 0, got {sampling.temperature}"
    if not math.isfinite(sampling.top_p) or not 0 <= sampling.top_p <= 1:
        return f"top_p must be in [0, 1] (0 or 1 = no truncation), got {sampling.top_p}"
    if sampling.top_k < 0:
        return f"top_k must be >= 0 (0 = no truncation), got {sampling.top_k}"
    if not math.isfinite(sampling.min_p) or not 0 <= sampling.min_p <= 1:
        return f"min_p must be in [0, 1] (0 = no truncation), got {sampling.min_p}"
    if not math.isfinite(sampling.typical_p) or not 0 <= sampling.typical_p <= 1:
        return f"typical_p must be in [0, 1] (0 or 1 = no truncation), got {sampling.typical_p}"
    if spec.session_max_new_tokens < 0:
        return f"params.max_new_tokens must be >= 0, got {spec.session_max_new_tokens}"
    if spec.max_new_tokens < 0:
        return f"max_new_tokens must be >= 0 (0 = until the session finishes), got {spec.max_new_tokens}"
    if spec.prediction_token_ids:
        low, high = min(spec.prediction_token_ids), max(spec.prediction_token_ids)
        if low < 0 or (target.vocab_size and high >= target.vocab_size):
            bad = low if low < 0 else high
            return f"prediction_token_ids contain {bad}, outside the target vocabulary [0, {target.vocab_size})"
        if len(spec.prediction_token_ids) > MAX_PREDICTION_TOKENS:
            return (f"prediction_token_ids holds {len(spec.prediction_token_ids)} tokens, "
                    f"more than {MAX_PREDICTION_TOKENS}")
    return _address_problem(spec.target_address)


def _address_problem(address: str) -> str | None:
    """One "host:port" or empty (the draft's first target)."""
    if not address:
        return None
    if len(address) > MAX_ADDRESS_LEN:
        return f"target_address is longer than {MAX_ADDRESS_LEN} characters"
    try:
        entries = addresses.parse(address, "target_address")
    except ValueError as error:
        return str(error)
    if len(entries) != 1 or "," in address or address != address.strip():
        return f"target_address names one target (host:port), got {address!r}"
    return None
