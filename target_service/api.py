"""What goes in and out of ``TargetEngine``: plain dataclasses, no protobuf.

``convert.py`` translates them to and from the ``tandem.v1`` messages, so the engine can be
driven by tests (and by anything else in-process) without a network.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.v1 import common_pb2, target_pb2

NOT_FINISHED = common_pb2.FINISH_REASON_UNSPECIFIED
# Verdict statuses, as on the wire.
OK = target_pb2.VERDICT_STATUS_OK
STALE = target_pb2.VERDICT_STATUS_STALE
FINISHED = target_pb2.VERDICT_STATUS_FINISHED


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
class SparseQ:
    """The draft's proposal distribution at one position: probability ``probs[i]`` on ``token_ids[i]``."""

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class DraftBlock:
    """Draft tokens that extend exactly ``committed[:base_len] + assumed_token_ids``."""

    session_id: str
    base_len: int
    draft_token_ids: tuple[int, ...]
    assumed_token_ids: tuple[int, ...] = ()
    # One SparseQ per draft token; empty = one-hot q on each draft token (deterministic drafter).
    draft_probs: tuple[SparseQ, ...] = ()
    block_id: int = 0
    tokenizer_fingerprint: str = ""
    # Return this block's hidden states even when the session was not prefilled asking for them.
    return_hidden_states: bool = False
    # A token tree: each draft's parent (an earlier draft's index, or -1 for the last committed
    # token). Empty: a chain.
    draft_parents: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefillResult:
    token_id: int
    committed_len: int
    finish_reason: int
    hidden_states: torch.Tensor | None = None  # [prompt_len, hidden_size] when asked for


@dataclass(frozen=True)
class Verdict:
    block_id: int
    status: int  # OK, STALE or FINISHED
    committed_len: int
    # Committed draft tokens: committed_token_ids[:num_accepted] == draft_token_ids[:num_accepted].
    num_accepted: int = 0
    committed_token_ids: tuple[int, ...] = ()
    finish_reason: int = NOT_FINISHED
    # [len(committed_token_ids), hidden_size] (OK verdicts, when asked for): row i is the final
    # hidden state at the position whose logits produced committed_token_ids[i], i.e. the last
    # token committed before the block (row 0) and the accepted draft tokens (rows 1..): the
    # positions this verdict added to the KV cache. An empty block gives one row.
    hidden_states: torch.Tensor | None = None
    verify_seconds: float = 0.0


@dataclass(frozen=True)
class GenerateResult:
    token_ids: tuple[int, ...]
    committed_len: int
    finish_reason: int
