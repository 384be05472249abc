"""Plain values the gateway exchanges with its upstreams; protobuf appears only in ``wire.py``.

The generation code (``generation``, ``target_session``, ``leg_reader``, ``output``) works with
these and never builds or reads a ``tandem.v1`` message, so wire details (enum numbering, field
presence) live in one place and the session logic reads as plain Python. The gRPC clients in
``upstream.py`` still speak protobuf; ``wire.py`` converts on the way in and out.

Invariant: nothing here imports ``tandem.v1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.policy import Mode
from tandem.rpc.types import (  # noqa: F401 (shared with the draft and the target; re-exported)
    FinishReason,
    SamplingParams,
    SessionParams,
    TokenLogprob,
)


@dataclass(frozen=True)
class Batch:
    """Tokens one upstream message committed, with the round that produced them (if speculative)."""

    token_ids: Sequence[int]
    finish_reason: FinishReason
    committed_len: int
    # The mode whose upstream sent it; None for the first token, which Prefill returns.
    mode: Mode | None = None
    num_draft_tokens: int = 0
    num_accepted: int = 0
    # Speculative rounds only: the deepest draft path of the block (0: the draft did not say),
    # and the seconds the target spent verifying it.
    num_draft_positions: int = 0
    verify_seconds: float = 0.0
    # Of num_draft_tokens, those copied from the request's prediction; of num_accepted, those accepted.
    num_prediction_drafts: int = 0
    num_prediction_accepted: int = 0
    # What a pass of one row per session costs the target now, estimated by it (0: not reported),
    # and, for a Generate message, the pass that decoded it (the two differ beside speculating
    # sessions, whose rows widen the pass): the step that speculation is weighed against.
    step_seconds: float = 0.0
    pass_seconds: float = 0.0
    # One per token of token_ids when the request asked for log-probabilities, else ().
    logprobs: Sequence[TokenLogprob] = ()
    # A Prefill's: prompt tokens whose KV cache the target copied instead of prefilling them, and
    # when asked for, the log-probabilities of the prompt's tokens after the first.
    cached_tokens: int = 0
    prompt_logprobs: Sequence[TokenLogprob] = ()
