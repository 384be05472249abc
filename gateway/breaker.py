"""A circuit breaker in front of the draft service.

When the draft is down, every new session that tried it would pay a failed call (or worse, a
stall until the deadline) before falling back. The breaker remembers the outage instead:

* **closed** (draft healthy): sessions speculate. A failed Speculate counts; an unreachable or
  stalled draft, or ``failure_threshold`` failures in a row, or a failed health probe, opens it.
* **open**: new sessions start in fallback (reason ``draft_unavailable``) and sessions already in
  fallback do not re-probe. The gateway's periodic health probe is the only traffic to the draft.
* **half-open**: once a health probe succeeds at least ``cooldown_s`` after opening (at once when
  only health probes ever failed, e.g. a draft still loading at start-up), sessions may
  speculate again. The first speculative round that succeeds closes the breaker; a failure opens
  it again with the cooldown doubled (up to ``max_cooldown_s``), so a draft that answers health
  checks but fails real work is not hammered.

The clock is injected, so tests drive it without sleeping.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.config import GatewaySettings

log = logging.getLogger(__name__)


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class DraftFailure(str, enum.Enum):
    """How a Speculate call went wrong; the first two open the breaker at once."""

    UNREACHABLE = "unreachable"
    STALLED = "stalled"
    FAILED = "failed"


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 3
    cooldown_s: float = 2.0
    max_cooldown_s: float = 30.0

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> BreakerConfig:
        return cls(settings.draft_breaker_failures, settings.draft_breaker_cooldown_s)


class DraftBreaker:
    def __init__(self, config: BreakerConfig = BreakerConfig(), clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.state = BreakerState.CLOSED
        self._failures_in_a_row = 0
        self._opened_at = 0.0
        self._cooldown_s = config.cooldown_s
        # Opened by a failed health probe, no session having seen the draft fail since.
        self._opened_by_probe = False
        # Whether a health probe ever found the draft serving (before that, at start-up, a draft
        # that is not serving yet is still loading, not an outage worth a warning).
        self._seen_serving = False

    @property
    def allows_speculation(self) -> bool:
        return self.state is not BreakerState.OPEN

    def record_success(self) -> None:
        """A speculative round came back."""
        self._failures_in_a_row = 0
        if self.state is not BreakerState.CLOSED:
            log.info("draft service recovered: speculation resumes for new sessions")
            self.state = BreakerState.CLOSED
            self._cooldown_s = self.config.cooldown_s

    def record_failure(self, failure: DraftFailure) -> None:
        self._failures_in_a_row += 1
        self._opened_by_probe = False
        if self.state is BreakerState.HALF_OPEN:
            self._cooldown_s = min(self._cooldown_s * 2, self.config.max_cooldown_s)
            self._open(f"the draft failed again ({failure.value})")
        elif self.state is BreakerState.CLOSED and (
            failure is not DraftFailure.FAILED or self._failures_in_a_row >= self.config.failure_threshold
        ):
            self._open(f"the draft is {failure.value}" if failure is not DraftFailure.FAILED
                       else f"{self._failures_in_a_row} Speculate calls failed in a row")

    def probe(self, serving: bool) -> None:
        """The result of a health probe of the draft (the monitor's periodic check)."""
        if not serving:
            if self.state is not BreakerState.OPEN:
                self._open("the draft's health check failed", quiet=not self._seen_serving)
                self._opened_by_probe = True
            else:
                self._opened_at = self._clock()  # still down: the cooldown restarts
            return
        first, self._seen_serving = not self._seen_serving, True
        cooled = self._opened_by_probe or self._clock() - self._opened_at >= self._cooldown_s
        if self.state is BreakerState.OPEN and cooled:
            # At start-up (never serving before) that is no recovery worth a line.
            log.log(logging.DEBUG if first else logging.INFO,
                    "draft service answers its health check again: new sessions may speculate (half-open)")
            self.state = BreakerState.HALF_OPEN

    def _open(self, why: str, quiet: bool = False) -> None:
        if quiet:
            log.info("the draft service is not serving yet: new sessions decode autoregressively until it is")
        else:
            log.warning("draft circuit breaker open (%s): new sessions decode autoregressively", why)
        self.state = BreakerState.OPEN
        self._opened_at = self._clock()
