"""The temperature prior (gateway.prior): what speculation measured per temperature band decides
whether a new ``auto`` session speculates, and sessions report what they measured."""

from __future__ import annotations

import pytest

from gateway.adaptive import AdaptiveConfig, Round, SessionController
from gateway.step_time import StepTimer
from gateway.policy import PRIOR_SLOWER, Decision, Mode, PolicyConfig, SpeculationPolicy
from gateway.prior import PriorConfig, TemperaturePrior, band, load_band
from gateway.request import GenerationRequest, SamplingParams, Speculation

SPEC, AR = Mode.SPECULATIVE, Mode.AUTOREGRESSIVE


def request(temperature: float, speculation=Speculation.AUTO) -> GenerationRequest:
    return GenerationRequest((1, 2), 100, SamplingParams(temperature, 1.0, 0, None), (), (), False, speculation, None)


@pytest.mark.parametrize(("temperature", "name"), [(0.0, "0"), (0.2, "0-0.35"), (0.7, "0.35-0.75"),
                                                   (1.0, "0.75-1.05"), (1.2, "1.05-1.5"), (2.0, "1.5+")])
def test_bands(temperature: float, name: str) -> None:
    assert band(temperature) == name


def test_the_prior_decides_nothing_before_enough_sessions_reported() -> None:
    prior = TemperaturePrior(PriorConfig(min_sessions=3))
    for _ in range(2):
        prior.observe(1.0, seconds_per_token=0.03, step_seconds=0.02)  # 1.5x slower than decoding alone
    assert prior.ratio(1.0) is None and not prior.holds_back(1.0)
    prior.observe(1.0, 0.03, 0.02)
    assert prior.ratio(1.0) == pytest.approx(1.5) and prior.holds_back(1.0)
    assert not prior.holds_back(0.0) and not prior.holds_back(0.5)  # other bands know nothing yet


def test_speculation_that_pays_is_never_held_back() -> None:
    prior = TemperaturePrior(PriorConfig(min_sessions=1, margin=0.05))
    prior.observe(1.0, 0.0204, 0.02)  # 2% slower: within the margin
    assert not prior.holds_back(1.0)
    prior.observe(0.0, 0.01, 0.02)
    assert prior.ratio(0.0) < 1 and not prior.holds_back(0.0)


def test_held_back_bands_still_explore_and_follow_new_measurements() -> None:
    updates = []
    prior = TemperaturePrior(PriorConfig(min_sessions=1, alpha=0.5, explore_every=4),
                             on_update=lambda name, load, ratio: updates.append((name, load, ratio)))
    prior.observe(1.0, 0.04, 0.02)
    assert [prior.holds_back(1.0) for _ in range(8)] == [True, True, True, False] * 2
    for _ in range(4):  # the explorers (and probes) measure that it pays now
        prior.observe(1.0, 0.01, 0.02)
    assert not prior.holds_back(1.0)
    assert updates[0] == ("0.75-1.05", "1", 2.0) and updates[-1][2] < 1.0


@pytest.mark.parametrize(("sessions", "name"), [(0, "1"), (1, "1"), (2, "2-3"), (3, "2-3"), (4, "4-7"), (7, "4-7"),
                                                (8, "8+"), (100, "8+")])
def test_load_bands(sessions: int, name: str) -> None:
    assert load_band(sessions) == name


def test_what_speculation_measured_under_load_holds_back_only_sessions_under_that_load() -> None:
    """Eight sessions a target measured speculation slower (their rows share every pass); a lone
    session after the burst still speculates, and the policy asks the prior at the session's load."""
    prior = TemperaturePrior(PriorConfig(min_sessions=1, explore_every=100))
    for _ in range(8):
        prior.observe(0.0, 0.04, 0.02, tokens=64, sessions=8)
    assert prior.ratio(0.0, sessions=8) == pytest.approx(2.0) and prior.holds_back(0.0, sessions=12)
    assert prior.ratio(0.0, sessions=1) is None and not prior.holds_back(0.0, sessions=1)
    prior.observe(0.0, 0.01, 0.02, tokens=64, sessions=1)
    assert prior.ratio(0.0) == pytest.approx(0.5)
    policy = SpeculationPolicy(PolicyConfig(), prior)
    assert policy.initial(request(0.0), True, active_sessions=7, load=8) == Decision(AR, PRIOR_SLOWER)
    assert policy.initial(request(0.0), True, active_sessions=0, load=1) == Decision(SPEC)


def test_a_report_weighs_as_many_tokens_as_its_session_speculated() -> None:
    """Sessions that fell back after a few tokens measured only their first rounds; a streak of them
    must not outvote the long sessions that paid."""
    prior = TemperaturePrior(PriorConfig(min_sessions=1, alpha=0.2))
    prior.observe(0.0, 0.01, 0.02, tokens=64)  # half the step's time over a whole session
    for _ in range(3):
        prior.observe(0.0, 0.036, 0.02, tokens=10)  # 1.8x slower over a first window
    # (0.512 x 64 x 0.01 + 0.2 x 10 x 0.036 x (1 + 0.8 + 0.64)) / (0.512 x 64 x 0.02 + ... x 0.02 ...)
    spec = 0.512 * 64 * 0.01 + 0.2 * 10 * 0.036 * (1 + 0.8 + 0.64)
    step = 0.512 * 64 * 0.02 + 0.2 * 10 * 0.02 * (1 + 0.8 + 0.64)
    assert prior.ratio(0.0) == pytest.approx(spec / step)
    assert prior.ratio(0.0) < 0.8 and not prior.holds_back(0.0)
    unweighted = TemperaturePrior(PriorConfig(min_sessions=1, alpha=0.2))
    unweighted.observe(0.0, 0.01, 0.02)
    for _ in range(3):
        unweighted.observe(0.0, 0.036, 0.02)
    assert unweighted.ratio(0.0) > 1.1 and unweighted.holds_back(0.0)  # what equal weights did


def test_bad_measurements_are_ignored() -> None:
    prior = TemperaturePrior(PriorConfig(min_sessions=1))
    prior.observe(1.0, 0.0, 0.02)
    prior.observe(1.0, 0.01, 0.0)
    assert prior.ratio(1.0) is None


def test_the_policy_starts_a_measured_slower_temperature_autoregressively() -> None:
    prior = TemperaturePrior(PriorConfig(min_sessions=1, explore_every=100))
    prior.observe(1.0, 0.04, 0.02)
    policy = SpeculationPolicy(PolicyConfig(), prior)
    assert policy.initial(request(1.0), True) == Decision(AR, PRIOR_SLOWER)
    assert policy.initial(request(0.0), True) == Decision(SPEC)
    assert policy.initial(request(1.0, Speculation.ON), True) == Decision(SPEC)  # "on" overrides every rule
    assert policy.may_return(PRIOR_SLOWER)  # such sessions still probe, and their probes report


def _controller(reports: list, adaptive: bool = True) -> SessionController:
    timer = StepTimer(alpha=1.0)
    timer.observe_step(0.02)
    config = AdaptiveConfig(window_rounds=8, warmup_rounds=4, reprobe_after_tokens=16, probe_tokens=4)
    return SessionController(config, timer, Decision(SPEC), policy=SpeculationPolicy(), can_speculate=lambda: True,
                             adaptive=adaptive, report=lambda spt, tokens: reports.append((spt, tokens)))


def test_a_session_reports_at_its_end_what_speculation_gave_it() -> None:
    reports: list = []
    c = _controller(reports)
    c.next_leg()
    for _ in range(4):  # a slow start, then rounds that pay: the whole session counts, not its first window
        c.observe_round(Round(committed=1, drafted=4, accepted=0, seconds=0.05))
    c.next_leg()  # falls back on the first window ...
    c.observe_autoregressive(16)
    c.next_leg()  # ... probes ...
    for _ in range(4):
        c.observe_round(Round(committed=5, drafted=4, accepted=4, seconds=0.05))
    c.next_leg()
    assert reports == []
    c.finish()
    c.finish()  # once
    assert reports == [(pytest.approx(8 * 0.05 / 24), 24)]


def test_a_session_too_short_to_judge_reports_nothing() -> None:
    reports: list = []
    c = _controller(reports)
    c.next_leg()
    c.observe_round(Round(committed=1, drafted=4, accepted=0, seconds=None))  # a stream's first message: untimed
    for _ in range(3):
        c.observe_round(Round(committed=3, drafted=4, accepted=2, seconds=0.03))
    c.finish()
    assert reports == []
