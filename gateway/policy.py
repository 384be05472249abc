"""Up-front choice between speculative and plain autoregressive decoding for a new session.

Some sessions are known not to profit from speculation before their first token:

* ``speculation: "off"`` in the request (reason ``speculation_off``);
* a sampling temperature above ``max_temperature`` (reason ``high_temperature``; default: none,
  every temperature may speculate);
* a sampled request that names a ``seed`` (reason ``seeded``): the seed fixes the session's draws,
  and autoregressive decoding takes one draw per token, so the same request gives the same tokens
  whatever the load; speculative decoding keeps the target's distribution, but which draw decides
  which position depends on the drafts, which adapt to measured timings (docs/sampling.md#seeds);
* a temperature at which speculation measured slower than autoregressive decoding on this server
  (:mod:`gateway.prior`; reason ``prior_slower``): the draft's and the target's distributions drift
  apart as they flatten, so acceptance falls, but by how much depends on the host, the models
  and the text, so the server measures it rather than assuming a cut;
* more than ``max_speculative_sessions`` (default 64) sessions active: the target's compute is
  better spent on decoding than on verifying rejected drafts (reason ``saturated``). The target
  batches the sessions waiting together, and a pass costs about the same for one row as for a few,
  so under heavy load plain decoding serves more while a few sessions still gain from speculation
  (docs/target.md#continuous-batching);
* the draft's circuit breaker is open (reason ``draft_unavailable``).

Each rule is configurable (``None`` disables a threshold) and each fallback is recorded with its
reason. ``speculation: "on"`` bypasses every rule: the client asked to speculate or fail. Switches
*during* a session are decided by :mod:`gateway.adaptive`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gateway.prior import TemperaturePrior
from gateway.request import GenerationRequest, Speculation
from tandem.config import GatewaySettings

DRAFT_UNAVAILABLE = "draft_unavailable"
SPECULATION_OFF = "speculation_off"
HIGH_TEMPERATURE = "high_temperature"
SATURATED = "saturated"
LOW_ACCEPTANCE = "low_acceptance"
SLOWER_THAN_AUTOREGRESSIVE = "slower_than_autoregressive"
PRIOR_SLOWER = "prior_slower"
SEEDED = "seeded"


class Mode(str, enum.Enum):
    """How a session is being decoded right now (the ``mode`` label of tandem_sessions_active)."""

    SPECULATIVE = "speculative"
    AUTOREGRESSIVE = "autoregressive"


@dataclass(frozen=True)
class Decision:
    mode: Mode
    # Why the session decodes autoregressively (None when it speculates).
    fallback_reason: str | None = None


@dataclass(frozen=True)
class PolicyConfig:
    max_temperature: float | None = None
    max_speculative_sessions: int | None = 64

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> PolicyConfig:
        return cls(settings.fallback_max_temperature, settings.fallback_max_sessions or None)


class SpeculationPolicy:
    def __init__(self, config: PolicyConfig = PolicyConfig(), prior: TemperaturePrior | None = None) -> None:
        self.config = config
        self.prior = prior if prior is not None else TemperaturePrior()

    def initial(self, request: GenerationRequest, draft_ready: bool, active_sessions: int = 0,
                load: int = 1) -> Decision:
        """The mode a session starts in. ``draft_ready``: the draft's breaker lets sessions
        speculate; ``active_sessions``: sessions in progress, this one not included; ``load``:
        sessions in progress per target, this one included (the prior's load band)."""
        if request.speculation is Speculation.OFF:
            return Decision(Mode.AUTOREGRESSIVE, SPECULATION_OFF)
        if request.speculation is Speculation.ON:
            return Decision(Mode.SPECULATIVE)
        limit = self.config.max_temperature
        if limit is not None and request.sampling.temperature > limit:
            return Decision(Mode.AUTOREGRESSIVE, HIGH_TEMPERATURE)
        if request.sampling.seed is not None and not request.sampling.greedy:
            return Decision(Mode.AUTOREGRESSIVE, SEEDED)
        if self.saturated(active_sessions):
            return Decision(Mode.AUTOREGRESSIVE, SATURATED)
        if not draft_ready:
            return Decision(Mode.AUTOREGRESSIVE, DRAFT_UNAVAILABLE)
        if self.prior.holds_back(request.sampling.temperature, load):
            return Decision(Mode.AUTOREGRESSIVE, PRIOR_SLOWER)
        return Decision(Mode.SPECULATIVE)

    def saturated(self, active_sessions: int) -> bool:
        limit = self.config.max_speculative_sessions
        return limit is not None and active_sessions >= limit

    @staticmethod
    def may_return(reason: str | None) -> bool:
        """Whether a session that fell back for ``reason`` may later probe speculation again:
        not when the reason is fixed for the session's lifetime (its request)."""
        return reason not in (SPECULATION_OFF, HIGH_TEMPERATURE, SEEDED)
