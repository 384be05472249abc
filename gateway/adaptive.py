"""Mid-session switching between speculation and the target's ``Generate``, with re-probing.

Speculation pays only when a round (draft K tokens + one verification) commits tokens faster than
the target alone would: with round time ``r``, ``c`` tokens committed per round and the target's
single-step time ``s``, speculation wins while ``r / c < s``. A :class:`SessionController` keeps a
window of the session's recent rounds and, after a warm-up, falls back when

* the acceptance over the window is below ``min_acceptance`` (reason ``low_acceptance``), or
* the measured time per committed token exceeds the target's step time by more than the
  hysteresis margin (reason ``slower_than_autoregressive``).

A window of a few rounds says little on its own, and a session's first rounds are its worst
(prompt lookup has no output to copy yet, the feature-conditioned head waits for its first
feature): judged on them alone, sessions that paid over their whole length fell back after their
first leg. So the time rule weighs the window against what the server has measured at the
session's temperature (``gateway.prior``: speculative time per token over the step, averaged
over finished sessions), counted as ``prior_tokens`` committed tokens at that ratio; before the
server has measured anything, at break-even. The window must outweigh that evidence to move the
session, in either direction.

Acceptance here is accepted drafts over the drafts that could have been accepted (the draft's
``num_draft_positions``): a chain's length, but only the deepest root path of a token tree, of
which one path at most is accepted: counted per node, a tree reads as less accepting than a chain
drafting as well, and sessions whose drafts paid fell below the floor
(figures: docs/fallback.md#fallback-floor).

After ``reprobe_after_tokens`` tokens in fallback it runs a short speculative probe; the session
returns to speculation only when the probe clears the bar by the hysteresis margin, and each
failed probe doubles the wait before the next, so a session does not flap.

Switching is only safe where an upstream stream ends by itself (a ``Speculate`` with
``max_new_tokens``, a ``Generate`` with ``max_new_tokens``): cancelling a stream in the middle
could let the target commit tokens the gateway never sees. So the controller plans *legs* — how
many tokens the next stream should commit, and in which mode — and decides only between legs. A
speculative leg is sized to a number of rounds, so decisions come about as often as the window
refills; it ends after the round that reaches its size (rounds are not cut short for a leg, so it
may commit up to K more), a ``Generate`` leg exactly at its size.

Times are measured by the gateway (gaps between upstream messages) for both modes, so network
and serialisation costs weigh on both sides alike. The target's step time is shared by all
sessions of a load (:class:`gateway.step_time.StepTimer`): the step a session would take at that
load if it decoded autoregressively, as the target prices it, plus what a step costs beyond the
target's pass.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gateway.policy import (
    DRAFT_UNAVAILABLE,
    LOW_ACCEPTANCE,
    SLOWER_THAN_AUTOREGRESSIVE,
    Decision,
    Mode,
    SpeculationPolicy,
)
from gateway.step_time import StepTimer
from tandem.config import GatewaySettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdaptiveConfig:
    # Measurement-based switching; when False, sessions still return after a draft outage.
    enabled: bool = True
    window_rounds: int = 8
    warmup_rounds: int = 4
    # A floor for hopeless drafts, not the test of payoff (the time rule is); set low enough that
    # sessions which pay do not fall back on an unlucky window (docs/fallback.md#fallback-floor).
    min_acceptance: float = 0.05
    # Relative margin between the bar to leave speculation and the bar to come back.
    hysteresis: float = 0.1
    # Committed tokens' worth of weight of the server's measured ratio in the time rule.
    prior_tokens: int = 16
    # A speculative leg lasts about this many rounds once the session is past its warm-up.
    segment_rounds: int = 16
    min_segment_tokens: int = 8
    reprobe_after_tokens: int = 64
    max_reprobe_after_tokens: int = 1024
    probe_tokens: int = 12

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> AdaptiveConfig:
        return cls(
            enabled=settings.fallback_adaptive,
            window_rounds=settings.fallback_window_rounds,
            warmup_rounds=settings.fallback_warmup_rounds,
            min_acceptance=settings.fallback_min_acceptance,
            hysteresis=settings.fallback_hysteresis,
            prior_tokens=settings.fallback_prior_tokens,
            reprobe_after_tokens=settings.fallback_reprobe_tokens,
            probe_tokens=settings.fallback_probe_tokens,
        )


@dataclass(frozen=True)
class Round:
    """One speculation round as the gateway saw it."""

    committed: int
    drafted: int
    accepted: int
    # Gateway-side time since the previous message of the same stream; None for a stream's
    # first message, whose time includes the call's set-up.
    seconds: float | None = None
    # The most drafts the round could have had accepted: ``drafted`` for a chain, the deepest
    # root path for a token tree (whose other branches can never all be accepted). None: drafted
    # (a chain, or a draft too old to send it).
    positions: int | None = None

    @property
    def acceptable(self) -> int:
        return self.drafted if self.positions is None else self.positions


@dataclass(frozen=True)
class Leg:
    """The next upstream stream: its mode and how many tokens it should commit (0: no limit;
    a speculative one ends after the round that reaches it)."""

    mode: Mode
    max_new_tokens: int = 0
    probe: bool = False


@dataclass(frozen=True)
class WindowStats:
    rounds: int
    acceptance: float | None  # accepted / acceptable drafts; None when no round drafted anything
    seconds_per_token: float | None  # None when no round was timed
    tokens_per_round: float
    timed_seconds: float = 0.0  # over the timed rounds
    timed_tokens: int = 0  # committed by the timed rounds


class SessionController:
    """Plans one session's legs; see the module doc."""

    def __init__(
        self,
        config: AdaptiveConfig,
        timer: StepTimer,
        start: Decision,
        *,
        policy: SpeculationPolicy,
        can_speculate: Callable[[], bool],
        adaptive: bool = True,
        report: Callable[[float, int], None] | None = None,
        prior_ratio: Callable[[], float | None] = lambda: None,
        load: Callable[[], int] = lambda: 1,
    ) -> None:
        """``can_speculate``: whether the draft's breaker and the server's load allow it now;
        ``adaptive``: False for ``speculation: "on"`` (never fall back by measurement);
        ``report(seconds_per_token, tokens)``: told at :meth:`finish` what speculation gave the
        session over all its timed rounds (the temperature prior, gateway.prior); ``prior_ratio()``:
        that prior's current ratio at the session's temperature (None while it has too few reports);
        ``load()``: sessions in progress per target now (the step is the target's at that load)."""
        self.config = config
        self._timer = timer
        self._policy = policy
        self._can_speculate = can_speculate
        self._adaptive = adaptive and config.enabled
        self.mode = start.mode
        self.reason = start.fallback_reason
        self._window: deque[Round] = deque(maxlen=config.window_rounds)
        self._stretch_rounds = 0  # rounds since the session last entered speculation
        self._probing = False
        self._fallback_tokens = 0
        self._reprobe_after = config.reprobe_after_tokens
        self._report = report
        self._prior_ratio = prior_ratio
        self._load = load
        self._timed_seconds = 0.0  # over every timed speculative round of the session
        self._timed_tokens = 0
        self._timed_rounds = 0

    # -- observations --------------------------------------------------------------------------

    def observe_round(self, round_: Round) -> None:
        self._window.append(round_)
        self._stretch_rounds += 1
        if round_.seconds is not None:
            self._timed_seconds += round_.seconds
            self._timed_tokens += round_.committed
            self._timed_rounds += 1

    def finish(self) -> None:
        """The session ended: reports its speculative time per token against the target's step, where
        it speculated for at least a warm-up's worth of timed rounds. The whole session rather than a
        window: its first rounds, before lookup has text to copy, are its worst, and a band's prior
        should hear what speculation gave, not what the first verdict feared."""
        if self._report is not None and self._timed_tokens and self._timed_rounds >= self.config.warmup_rounds:
            self._report(self._timed_seconds / self._timed_tokens, self._timed_tokens)
            self._report = None  # once

    def observe_autoregressive(self, tokens: int) -> None:
        self._fallback_tokens += tokens

    def stats(self) -> WindowStats:
        rounds = list(self._window)
        acceptable = sum(r.acceptable for r in rounds)
        timed = [r for r in rounds if r.seconds is not None]
        timed_tokens = sum(r.committed for r in timed)
        return WindowStats(
            rounds=len(rounds),
            acceptance=sum(r.accepted for r in rounds) / acceptable if acceptable else None,
            seconds_per_token=sum(r.seconds for r in timed) / timed_tokens if timed_tokens else None,
            tokens_per_round=sum(r.committed for r in rounds) / len(rounds) if rounds else 1.0,
            timed_seconds=sum(r.seconds for r in timed),
            timed_tokens=timed_tokens,
        )

    def judged_seconds_per_token(self, stats: WindowStats, step: float) -> float | None:
        """The window's time per committed token weighed with the server's prior (module doc)."""
        if not stats.timed_tokens:
            return None
        weight = self.config.prior_tokens
        ratio = self._prior_ratio()
        prior_seconds = weight * (1.0 if ratio is None else ratio) * step
        return (stats.timed_seconds + prior_seconds) / (stats.timed_tokens + weight)

    def step_s(self) -> float | None:
        """The target's step at the load now (:class:`StepTimer`)."""
        return self._timer.step_s(self._load())

    # -- decisions -----------------------------------------------------------------------------

    def describe(self) -> str:
        """The window the last decision read, for the log line of a switch."""
        stats, step = self.stats(), self.step_s()
        parts = [f"{stats.rounds} rounds, {stats.tokens_per_round:.2f} tokens a round"]
        if stats.acceptance is not None:
            parts.append(f"acceptance {stats.acceptance:.2f}")
        if stats.seconds_per_token is not None and step is not None:
            judged = self.judged_seconds_per_token(stats, step)
            parts.append(f"{1000 * stats.seconds_per_token:.1f} ms a token ({1000 * judged:.1f} with the prior) "
                         f"against a {1000 * step:.1f} ms step")
        return ", ".join(parts)

    def fall_back(self, reason: str) -> Decision:
        """Forced switch to autoregressive decoding (the draft failed)."""
        self._enter_fallback(reason)
        return Decision(Mode.AUTOREGRESSIVE, reason)

    def next_leg(self) -> tuple[Leg, Decision | None]:
        """The next leg, and the switch it implies (None when the mode stays)."""
        if self.mode is Mode.SPECULATIVE:
            was_probing = self._probing
            reason = self._reason_to_leave()
            if reason is None:
                if was_probing:
                    self._reprobe_after = self.config.reprobe_after_tokens
                return Leg(Mode.SPECULATIVE, self._segment_tokens()), None
            if was_probing:
                self._reprobe_after = min(self._reprobe_after * 2, self.config.max_reprobe_after_tokens)
            self._enter_fallback(reason)
            return self._autoregressive_leg(), Decision(Mode.AUTOREGRESSIVE, reason)
        if self._may_probe():
            log.debug("probing speculation after %d tokens in fallback (%s)", self._fallback_tokens, self.reason)
            self.mode, self.reason, self._probing = Mode.SPECULATIVE, None, True
            self._window.clear()
            self._stretch_rounds = 0
            return Leg(Mode.SPECULATIVE, self.config.probe_tokens, probe=True), Decision(Mode.SPECULATIVE)
        return self._autoregressive_leg(), None

    def _reason_to_leave(self) -> str | None:
        """Why the session should stop speculating now, judged on the window; None to go on."""
        if self._probing:
            self._probing = False
            return self._verdict(self.stats(), strict=True) if self._adaptive else None
        if not self._adaptive or self._stretch_rounds < self.config.warmup_rounds:
            return None
        return self._verdict(self.stats(), strict=False)

    def _verdict(self, stats: WindowStats, strict: bool) -> str | None:
        """A reason to fall back, or None. ``strict`` (a probe deciding whether to come back)
        moves both bars by the hysteresis margin h: acceptance must reach min_acceptance (1 + h)
        and the time per token fall to step / (1 + h); to leave, acceptance must drop below
        min_acceptance or the time per token rise above step (1 + h)."""
        h = self.config.hysteresis
        min_acceptance = self.config.min_acceptance * (1 + h if strict else 1)
        if stats.acceptance is not None and stats.acceptance < min_acceptance:
            return LOW_ACCEPTANCE
        step = self.step_s()
        judged = None if step is None else self.judged_seconds_per_token(stats, step)
        if judged is not None:
            max_seconds = step / (1 + h) if strict else step * (1 + h)
            if judged > max_seconds:
                return SLOWER_THAN_AUTOREGRESSIVE
        return None

    def _segment_tokens(self) -> int:
        if not self._adaptive:
            return 0
        warm = self._stretch_rounds >= self.config.warmup_rounds
        rounds = self.config.segment_rounds if warm else self.config.window_rounds
        return max(self.config.min_segment_tokens, math.ceil(self.stats().tokens_per_round * rounds))

    def _may_probe(self) -> bool:
        if not self._policy.may_return(self.reason):
            return False
        if self.reason != DRAFT_UNAVAILABLE and not self._adaptive:
            return False
        return self._fallback_tokens >= self._reprobe_after and self._can_speculate()

    def _autoregressive_leg(self) -> Leg:
        if not self._policy.may_return(self.reason) or (self.reason != DRAFT_UNAVAILABLE and not self._adaptive):
            return Leg(Mode.AUTOREGRESSIVE)
        return Leg(Mode.AUTOREGRESSIVE, max(1, self._reprobe_after - self._fallback_tokens))

    def _enter_fallback(self, reason: str) -> None:
        self.mode, self.reason, self._probing = Mode.AUTOREGRESSIVE, reason, False
        self._fallback_tokens = 0
