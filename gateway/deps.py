"""What every generation shares: upstream pools, policy, tuning and background tasks.

One ``GenerationDeps`` is built by the gateway at start-up and handed to each ``Generation``.
Invariant: generations never assign its fields; what they count together goes through its
:class:`gateway.counters.SessionCounters`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from gateway.adaptive import AdaptiveConfig
from gateway.step_time import StepTimer
from gateway.counters import SessionCounters
from gateway.draft_speeds import DraftSpeeds
from gateway.prefix_affinity import PrefixAffinity
from gateway.pacer import PacerConfig
from gateway.policy import SpeculationPolicy
from gateway.pool import Pool
from gateway.request import Smoothing
from gateway.served_model import ServedModel
from gateway.upstream import DraftUpstream, TargetUpstream
from tandem.config import GatewaySettings
from tandem.telemetry.metrics import Metrics


class BackgroundTasks:
    """Keeps strong references to fire-and-forget tasks (asyncio holds only weak ones) so that a
    session release started by a cancelled request still runs to completion."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclass(frozen=True)
class SessionTuning:
    """How sessions stream and switch, as the gateway's settings fix it."""

    smoothing: Smoothing = Smoothing.OFF  # the default of requests that do not say
    pacer: PacerConfig = PacerConfig()
    adaptive: AdaptiveConfig = AdaptiveConfig()
    # A Speculate stream silent for this long counts as a stalled draft, unless the silence is
    # explained by a busy target (GenerationDeps.draft_silence_explained) ...
    draft_stall_timeout_s: float = 5.0
    # ... for at most this many times as long.
    draft_stall_cap_factor: float = 12.0
    # A target silent this long is asked for its health (as long again); failing it, it is dead.
    target_timeout_s: float = 10.0
    # How long a session whose target died waits for a serving target before it fails.
    failover_wait_s: float = 60.0

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> SessionTuning:
        return cls(
            smoothing=Smoothing(settings.stream_smoothing),
            pacer=PacerConfig(max_delay_rounds=settings.stream_smoothing_max_delay_rounds),
            adaptive=AdaptiveConfig.from_settings(settings),
            draft_stall_timeout_s=settings.draft_stall_timeout_s,
            target_timeout_s=settings.target_timeout_s,
            failover_wait_s=settings.failover_wait_s,
        )


@dataclass
class GenerationDeps:
    """What a generation needs from the gateway; one instance is shared by all requests."""

    targets: Pool[TargetUpstream]
    drafts: Pool[DraftUpstream]
    model: ServedModel
    policy: SpeculationPolicy
    metrics: Metrics
    draft_ready: Callable[[], bool]
    default_num_speculative_tokens: int
    background: BackgroundTasks = field(default_factory=BackgroundTasks)
    tuning: SessionTuning = field(default_factory=SessionTuning)
    step_timer: StepTimer = field(default_factory=StepTimer)
    # What each draft's legs committed per second, by target: where the next leg goes.
    draft_speeds: DraftSpeeds = field(default_factory=DraftSpeeds)
    # Which target holds the beginning of which prompts: where a new session goes.
    prefix_affinity: PrefixAffinity = field(default_factory=PrefixAffinity)
    # Sessions in progress, Prefill calls in flight, the last draft message: what every
    # generation reports (built from ``metrics``, whose session gauges it keeps).
    counters: SessionCounters = field(init=False)

    def __post_init__(self) -> None:
        self.counters = SessionCounters(self.metrics)

    def sessions_per_target(self, sessions: int | None = None) -> int:
        """``sessions`` in progress at the gateway (default: now) as sessions per target of the pool."""
        if sessions is None:
            sessions = self.counters.active_sessions
        return math.ceil(sessions / max(1, len(self.targets.members)))

    def can_speculate(self) -> bool:
        """Whether a draft of the pool may take a speculative leg now."""
        return self.draft_ready() and self.drafts.can_place()

    def draft_silence_explained(self, now: float) -> bool:
        """Whether a silent Speculate stream is waiting behind a busy target rather than on a
        stalled draft (:meth:`SessionCounters.draft_silence_explained`, at the stall deadline)."""
        return self.counters.draft_silence_explained(now, self.tuning.draft_stall_timeout_s)
