"""What a generation emits: text deltas, then one finish with the usage.

These are the only types the HTTP and gRPC layers see of a generation, so both shape their
responses from the same events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.policy import Mode
from tandem.rpc.types import TokenLogprob


@dataclass
class SpeculationStats:
    """The ``speculative_decoding`` object of the usage: what speculation did for this request.

    A *round* is one verified draft block that proposed at least one token (a round in which the
    drafter had nothing to propose commits the target's own token and is not counted).
    ``fallbacks`` counts the server's switches to autoregressive decoding (not the client's
    ``speculation: "off"``); ``fallback_reason`` says why the request last decoded that way, the
    client's choice included (None when it never did). ``empty_rounds`` counts the verified blocks
    that carried no drafts (each committed one target token): a speculative request with no
    rounds says so there.
    """

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    fallbacks: int = 0
    fallback_reason: str | None = None
    empty_rounds: int = 0
    # With a predicted output: drafts copied from it, and those of them accepted (draft_service.prediction).
    prediction_drafts: int = 0
    prediction_accepted: int = 0
    # Modes that produced tokens after the first one (which always comes from Prefill).
    modes_used: set[Mode] = field(default_factory=set)
    final_mode: Mode = Mode.SPECULATIVE

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mode(self) -> str:
        """"speculative", "autoregressive", or "mixed" when both produced tokens."""
        if len(self.modes_used) > 1:
            return "mixed"
        return next(iter(self.modes_used), self.final_mode).value

    def to_json(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mode": self.mode,
            "fallbacks": self.fallbacks,
            "fallback_reason": self.fallback_reason,
            "empty_rounds": self.empty_rounds,
        }


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    speculative_decoding: SpeculationStats
    cached_prompt_tokens: int = 0  # of prompt_tokens, those the target did not prefill (its prefix cache)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TextDelta:
    """Text that became printable, and the tokens committed since the previous delta (with their
    log-probabilities, one per token, when the request asked for them)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    usage: Usage


Event = TextDelta | Finished
