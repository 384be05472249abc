"""What goes in and out of ``TargetEngine``: plain dataclasses and enums, no protobuf.

``wire.py`` translates them to and from the ``tandem.v1`` messages, so the engine can be driven by
tests (and by anything else in-process) without a network. The block, the verdict and the finish
reasons are the ones the draft and the gateway use too (``tandem.rpc.types``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.rpc.types import (  # noqa: F401 (re-exported for the target's modules)
    DraftBlock,
    FinishReason,
    Grammar,
    GrammarKind,
    SessionParams,
    SparseDist,
    TokenLogprob,
    Verdict,
    VerdictStatus,
)


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    dtype: str
    device: str
    max_context_len: int
    eos_token_ids: tuple[int, ...]
    hidden_size: int
    verifier_backend: str


@dataclass(frozen=True)
class TargetLoad:
    """How busy the target is right now (``TargetService.Info``'s load fields), read fresh per call
    so a gateway in front of a pool of targets can place a new session on the least loaded one.

    Invariants: ``0 <= kv_free_tokens <= kv_capacity_tokens``; both are 0 when no KV budget is
    configured (then the target admits sessions by ``max_sessions`` alone).
    """

    active_sessions: int  # live sessions: created and not finished, released or expired (they hold KV)
    kv_free_tokens: int  # KV positions not reserved by a live session
    kv_capacity_tokens: int  # the whole KV budget, in positions
    queued_passes: int  # calls (verify blocks, decode steps, prefill chunks) waiting for a pass


@dataclass(frozen=True)
class PrefillResult:
    token_id: int
    committed_len: int
    finish_reason: FinishReason
    hidden_states: torch.Tensor | None = None  # [prompt_len, hidden_size] when asked for
    logprobs: TokenLogprob | None = None  # the first token's, when the session asked for them
    cached_tokens: int = 0  # prompt tokens whose cache came from the prefix cache, not a prefill
    # When asked for: one per prompt token after the first (what each row of the prompt scored).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class GenerateResult:
    token_ids: tuple[int, ...]
    committed_len: int
    finish_reason: FinishReason
    # Timings, not part of the answer: the pass that decoded the token, every session's rows
    # included, and a pass of one row per session, estimated (TargetEngine.step_seconds).
    pass_seconds: float = field(default=0.0, compare=False)
    step_seconds: float = field(default=0.0, compare=False)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the session asked for them
