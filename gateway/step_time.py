"""The target's single-step time at each load: what a session's speculation is weighed against.

Under load the step a session would take decoding autoregressively is not the pass it shares:
beside speculating sessions a decoding step waits for their drafts' rows, and a speculating
session commits several tokens of each shared pass. Timed as it comes, a step then reads slow
exactly when every session speculates, and each session finds that speculation pays while it
costs them all (measured: docs/fallback.md#step-time). So the target names, with each verdict
and each decoded token, what a pass of one row per live session costs (``step_seconds``, from its
measured passes by their rows), and a step is that plus what a ``Generate`` step costs beyond its
pass (timed against the pass the target reports; the overhead measured at another load until this
one has its own, 0 before any). From a target that names neither, the steps as timed, and until
one was, a block's verification time (an upper bound of a step: it errs towards speculating).

Kept per load band (``gateway.prior.load_band``: sessions in progress per target), because a pass
of eight rows is not a pass of one: one average carried a burst's step to the lone sessions after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.prior import load_band


@dataclass
class _Timing:
    """What one load band has measured of the target's step."""

    estimate: float | None = None  # the target's step_seconds: a pass of one row per session
    overhead: float | None = None  # a Generate step's time beyond its pass (hop, loops)
    step: float | None = None  # timed Generate steps as they came (targets that report no estimate)
    verify: float | None = None  # block verifications (targets that report no estimate)


class StepTimer:
    """The step per load band, exponential averages shared by all sessions (see module doc)."""

    def __init__(self, alpha: float = 0.2) -> None:
        self._alpha = alpha
        self._bands: dict[str, _Timing] = {}
        self._overhead: float | None = None  # the latest bands' overhead, for bands without their own

    def observe_step(self, seconds: float, load: int = 1, pass_seconds: float = 0.0,
                     step_seconds: float = 0.0) -> None:
        """One ``Generate`` token, timed between two messages of a stream, with ``load`` sessions in
        progress per target; ``pass_seconds`` and ``step_seconds``: the target's (0: not reported)."""
        timing = self._band(load)
        if pass_seconds > 0 and step_seconds > 0:
            overhead = max(0.0, seconds - pass_seconds)
            timing.overhead = self._average(timing.overhead, overhead)
            self._overhead = self._average(self._overhead, overhead)
            timing.estimate = self._average(timing.estimate, step_seconds)
        else:
            timing.step = self._average(timing.step, seconds)

    def observe_verify(self, seconds: float, load: int = 1, step_seconds: float = 0.0) -> None:
        """A speculation round: the target's time to verify the block and its ``step_seconds``."""
        timing = self._band(load)
        if step_seconds > 0:
            timing.estimate = self._average(timing.estimate, step_seconds)
        elif seconds > 0:
            timing.verify = self._average(timing.verify, seconds)

    def step_s(self, load: int = 1) -> float | None:
        """The step at ``load`` sessions per target; None before anything was measured at that load."""
        timing = self._bands.get(load_band(load))
        if timing is None:
            return None
        if timing.estimate is not None:
            overhead = timing.overhead if timing.overhead is not None else self._overhead
            return timing.estimate + (overhead or 0.0)
        return timing.step if timing.step is not None else timing.verify

    def _band(self, load: int) -> _Timing:
        return self._bands.setdefault(load_band(load), _Timing())

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self._alpha * new + (1 - self._alpha) * old
