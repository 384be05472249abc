"""The step speculation is weighed against (``gateway.step_time``)."""

from __future__ import annotations

import pytest

from gateway.step_time import StepTimer


def test_step_timer_prefers_measured_steps_over_verify_times():
    """A target that names no step estimate (older ones): its steps as timed, a verification until then."""
    timer = StepTimer(alpha=0.5)
    assert timer.step_s() is None
    timer.observe_verify(0.2)
    assert timer.step_s() == 0.2
    timer.observe_step(0.1)
    timer.observe_step(0.05)
    assert timer.step_s() == pytest.approx(0.075)


def test_the_step_is_kept_per_load():
    """A step at one load says little of another (a pass of eight rows is not a pass of one): each
    load band keeps its own; a band that has only verdicts takes the target's price of a step and
    the overhead of a step measured at another load."""
    timer = StepTimer(alpha=1.0)
    timer.observe_step(0.012, load=1, pass_seconds=0.010, step_seconds=0.010)
    assert timer.step_s(1) == pytest.approx(0.012)
    assert timer.step_s(8) is None and timer.step_s(2) is None
    timer.observe_verify(0.065, load=8, step_seconds=0.024)
    assert timer.step_s(8) == pytest.approx(0.024 + 0.002) == timer.step_s(12)  # the 8+ band
    assert timer.step_s(1) == pytest.approx(0.012)


def test_a_step_beside_speculating_sessions_counts_as_a_step_among_decoding_ones():
    """Beside speculating sessions a decoding step waits for their drafts' rows (a 60 ms pass where
    eight decoding sessions take 23 ms): what counts is the target's price of the step plus the
    step's time beyond its pass."""
    timer = StepTimer(alpha=1.0)
    timer.observe_step(0.070, load=8, pass_seconds=0.060, step_seconds=0.023)
    assert timer.step_s(8) == pytest.approx(0.033)
