"""A validated generation request: what the gateway drives, independent of HTTP or gRPC.

``gateway.validation`` builds these from client input; ``gateway.generation`` consumes them.
Keeping them free of transport types lets both APIs share one validation path and one
generation path.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.rpc.types import Grammar, SamplingParams

if TYPE_CHECKING:
    from gateway.tools import ToolCalling


class Speculation(str, enum.Enum):
    """The ``speculation`` extension field: how the client wants the request decoded."""

    AUTO = "auto"  # the gateway's policy decides (speculate while the draft is available)
    ON = "on"  # speculate; fail rather than silently decode without the draft
    OFF = "off"  # the target's plain autoregressive Generate (the speed baseline)


class Smoothing(str, enum.Enum):
    """``--stream-smoothing`` and the per-request ``stream_smoothing`` extension field."""

    OFF = "off"  # send each batch of committed tokens as it arrives
    AUTO = "auto"  # pace streamed tokens at the measured verified-token rate (gateway.pacer)


@dataclass(frozen=True)
class GenerationRequest:
    """Everything one request fixes, already checked against the served model's limits."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    # Token ids that end generation besides the model's EOS (the client's, and a chat end-of-turn token).
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    speculation: Speculation
    # Draft length K for this request; None = the gateway's configured default.
    num_speculative_tokens: int | None
    # None = the gateway's --stream-smoothing.
    stream_smoothing: Smoothing | None = None
    # None: no log-probabilities; n: each generated token's and its n most probable alternatives'.
    top_logprobs: int | None = None
    # The response repeats the prompt, and with top_logprobs its tokens' log-probabilities (completions).
    echo: bool = False
    n: int = 1  # choices: each a generation of its own (gateway.choices)
    grammar: Grammar | None = None  # structured output (target_service.grammar)
    grammar_param: str = "response_format"  # the field that asked for the grammar (a refusal names it)
    presence_penalty: float = 0.0  # OpenAI's penalties (target_service.penalties)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF transformers', vLLM's and TGI's (target_service.penalties)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs (target_service.logit_bias)
    bad_words: tuple[tuple[int, ...], ...] = ()  # banned token sequences (gateway.token_masks, target_service.bad_words)
    allowed_token_ids: tuple[int, ...] = ()  # the only tokens generated (target_service.allowed_tokens); (): all
    tool_calling: ToolCalling | None = None  # chat: the answer is tool calls (gateway.tools)
    prediction_token_ids: tuple[int, ...] = ()  # a predicted output the draft copies from (draft_service.prediction)
    # The text of what stopped the answer (a stop string, a stop token that has text) is returned with it.
    include_stop_str_in_output: bool = False
    # vLLM's skip_special_tokens: special tokens' text (<start_of_turn>, <eos>, ...) is left out of the
    # answer; False keeps it, but for the token that ended the answer (gateway.output).
    skip_special_tokens: bool = True
    # vLLM's min_tokens: the answer's first tokens are never EOS or a stop token id (the target masks
    # them), and stop strings are looked for only in the text after them.
    min_tokens: int = 0

    @property
    def prompt_logprobs(self) -> bool:
        """Whether the target must score the prompt's own tokens."""
        return self.echo and self.top_logprobs is not None
