"""Up-front policies, the per-session controller (window, warm-up, hysteresis, re-probing) and the
draft's circuit breaker, as plain objects with fake clocks."""

from __future__ import annotations

import logging

import pytest

from gateway.adaptive import AdaptiveConfig, Leg, Round, SessionController
from gateway.step_time import StepTimer
from gateway.breaker import BreakerConfig, BreakerState, DraftBreaker, DraftFailure
from gateway.policy import (
    DRAFT_UNAVAILABLE,
    HIGH_TEMPERATURE,
    LOW_ACCEPTANCE,
    SATURATED,
    SEEDED,
    SLOWER_THAN_AUTOREGRESSIVE,
    SPECULATION_OFF,
    Decision,
    Mode,
    PolicyConfig,
    SpeculationPolicy,
)
from gateway.request import GenerationRequest, SamplingParams, Speculation

SPEC, AR = Mode.SPECULATIVE, Mode.AUTOREGRESSIVE


def request(speculation=Speculation.AUTO, temperature=0.0, seed=None) -> GenerationRequest:
    return GenerationRequest((1, 2), 100, SamplingParams(temperature, 1.0, 0, seed), (), (), False, speculation, None)


# ---- up-front policies -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("req", "ready", "active", "expected"),
    [
        (request(), True, 0, Decision(SPEC)),
        (request(Speculation.OFF), True, 0, Decision(AR, SPECULATION_OFF)),
        # No temperature cut by default: a fresh server speculates at any temperature (gateway.prior).
        (request(temperature=1.0), True, 0, Decision(SPEC)),
        (request(temperature=1.9), True, 0, Decision(SPEC)),
        (request(), True, 64, Decision(AR, SATURATED)),
        (request(), True, 63, Decision(SPEC)),
        (request(), False, 0, Decision(AR, DRAFT_UNAVAILABLE)),
        # A seeded sampled request keeps its tokens reproducible; a greedy one is reproducible anyway.
        (request(temperature=0.7, seed=5), True, 0, Decision(AR, SEEDED)),
        (request(temperature=0.0, seed=5), True, 0, Decision(SPEC)),
        # "on" means speculate or fail: no rule overrides it.
        (request(Speculation.ON, temperature=1.5), False, 100, Decision(SPEC)),
        (request(Speculation.ON, temperature=1.0, seed=5), True, 0, Decision(SPEC)),
    ],
)
def test_initial_decision(req, ready, active, expected):
    assert SpeculationPolicy().initial(req, ready, active) == expected


def test_thresholds_are_configurable_and_can_be_disabled():
    policy = SpeculationPolicy(PolicyConfig(max_temperature=None, max_speculative_sessions=None))
    assert policy.initial(request(temperature=2.0), True, 10_000) == Decision(SPEC)
    assert SpeculationPolicy(PolicyConfig(max_temperature=0.8)).initial(request(temperature=0.81), True, 0) == Decision(
        AR, HIGH_TEMPERATURE)
    assert SpeculationPolicy(PolicyConfig(max_temperature=0.8)).initial(request(temperature=0.8), True, 0) == Decision(SPEC)
    strict = SpeculationPolicy(PolicyConfig(max_temperature=0.3, max_speculative_sessions=2))
    assert strict.initial(request(temperature=0.5), True, 0) == Decision(AR, HIGH_TEMPERATURE)
    assert strict.initial(request(), True, 2) == Decision(AR, SATURATED)


# ---- the session controller --------------------------------------------------------------------

CONFIG = AdaptiveConfig(window_rounds=8, warmup_rounds=4, min_acceptance=0.6, hysteresis=0.1,
                        segment_rounds=16, min_segment_tokens=8, reprobe_after_tokens=32,
                        max_reprobe_after_tokens=128, probe_tokens=12)


def controller(start=Decision(SPEC), step_s=None, can_speculate=lambda: True, adaptive=True, config=CONFIG):
    timer = StepTimer(alpha=1.0)
    if step_s is not None:
        timer.observe_step(step_s)
    return SessionController(config, timer, start, policy=SpeculationPolicy(), can_speculate=can_speculate,
                             adaptive=adaptive)


def good(seconds=0.01):  # 4 of 4 accepted + bonus
    return Round(committed=5, drafted=4, accepted=4, seconds=seconds)


def bad(seconds=0.01):  # nothing accepted: the target's own token only
    return Round(committed=1, drafted=4, accepted=0, seconds=seconds)


def test_no_decision_before_the_warm_up():
    c = controller()
    leg, switch = c.next_leg()
    assert (leg, switch) == (Leg(SPEC, 8), None)  # first leg: window_rounds x 1 token
    for _ in range(3):
        c.observe_round(bad())
    assert c.next_leg() == (Leg(SPEC, 8), None)


def test_low_acceptance_falls_back_after_the_warm_up():
    c = controller()
    for _ in range(4):
        c.observe_round(bad())
    leg, switch = c.next_leg()
    assert switch == Decision(AR, LOW_ACCEPTANCE)
    assert leg == Leg(AR, 32)  # Generate until the re-probe


def test_high_acceptance_keeps_speculating_in_longer_segments():
    c = controller(step_s=0.05)
    for _ in range(4):
        c.observe_round(good())
    leg, switch = c.next_leg()
    assert switch is None and leg == Leg(SPEC, 5 * 16)


def test_slower_than_the_target_alone_falls_back():
    # 5 tokens in 0.5 s = 0.1 s per token, the target alone takes 0.05 s per token.
    c = controller(step_s=0.05)
    for _ in range(4):
        c.observe_round(good(seconds=0.5))
    assert c.next_leg()[1] == Decision(AR, SLOWER_THAN_AUTOREGRESSIVE)


def test_the_time_rule_weighs_the_window_against_the_servers_measured_ratio():
    # 20 tokens at 0.07 s each against a 0.05 s step: 40% slower over the window.
    def judged(prior_ratio, prior_tokens=16, seconds_per_token=0.07):
        config = AdaptiveConfig(**{**CONFIG.__dict__, "prior_tokens": prior_tokens})
        timer = StepTimer(alpha=1.0)
        timer.observe_step(0.05)
        c = SessionController(config, timer, Decision(SPEC), policy=SpeculationPolicy(), can_speculate=lambda: True,
                              prior_ratio=lambda: prior_ratio)
        for _ in range(4):
            c.observe_round(good(seconds=5 * seconds_per_token))
        return c

    # Before the server has measured anything the prior is break-even: (1.4 + 16 x 0.05) / 36 s a
    # token, 22% over the step, past the 10% margin.
    unknown = judged(None)
    assert unknown.judged_seconds_per_token(unknown.stats(), 0.05) == pytest.approx((1.4 + 0.8) / 36)
    assert unknown.next_leg()[1] == Decision(AR, SLOWER_THAN_AUTOREGRESSIVE)
    # Where finished sessions measured speculation at half the step's time, the same window is a
    # session's slow start: (1.4 + 16 x 0.025) / 36 = the step itself.
    assert judged(0.5).next_leg()[1] is None
    # Weightless, the window alone decides, as it did before the prior.
    assert judged(0.5, prior_tokens=0).next_leg()[1] == Decision(AR, SLOWER_THAN_AUTOREGRESSIVE)
    # A window at the step's own speed stays, unless the server's sessions measured speculation
    # slower there: (1.0 + 16 x 0.08) / 36 s a token.
    assert judged(None, seconds_per_token=0.05).next_leg()[1] is None
    slower_here = judged(1.6, seconds_per_token=0.05)
    assert "63.3 with the prior" in slower_here.describe()
    assert slower_here.next_leg()[1] == Decision(AR, SLOWER_THAN_AUTOREGRESSIVE)


def test_a_small_slowdown_within_the_margin_does_not_switch():
    c = controller(step_s=0.05)
    for _ in range(4):
        c.observe_round(good(seconds=5 * 0.054))  # 8% slower than the target: within h = 10%
    assert c.next_leg()[1] is None


def test_a_token_tree_is_judged_on_the_positions_it_could_have_had_accepted():
    # Five nodes over three positions, two accepted: 2/3 of what a chain could have done, above
    # the 0.6 floor; counted per node (2/5) the same rounds would fall back.
    tree = Round(committed=3, drafted=5, accepted=2, seconds=None, positions=3)
    c = controller()
    for _ in range(4):
        c.observe_round(tree)
    assert c.stats().acceptance == 2 / 3
    assert c.next_leg()[1] is None
    per_node = controller()
    for _ in range(4):
        per_node.observe_round(Round(committed=3, drafted=5, accepted=2, seconds=None))
    assert per_node.next_leg()[1] == Decision(AR, LOW_ACCEPTANCE)


def test_untimed_rounds_are_judged_on_acceptance_only():
    c = controller(step_s=0.001)
    for _ in range(4):
        c.observe_round(good(seconds=None))
    assert c.next_leg()[1] is None


def fall_back_on_low_acceptance(c: SessionController) -> None:
    for _ in range(4):
        c.observe_round(bad())
    assert c.next_leg()[1] == Decision(AR, LOW_ACCEPTANCE)


def test_reprobe_after_n_tokens_and_return_when_the_probe_is_good():
    c = controller(step_s=0.05)
    fall_back_on_low_acceptance(c)
    c.observe_autoregressive(31)
    assert c.next_leg() == (Leg(AR, 1), None)
    c.observe_autoregressive(1)
    leg, switch = c.next_leg()
    assert leg == Leg(SPEC, 12, probe=True) and switch == Decision(SPEC)
    for _ in range(3):
        c.observe_round(good())
    leg, switch = c.next_leg()
    assert switch is None and leg.mode is SPEC and not leg.probe


def test_a_failed_probe_doubles_the_wait_before_the_next():
    c = controller()
    fall_back_on_low_acceptance(c)
    for expected_wait in (64, 128, 128):  # doubled, up to the maximum
        c.observe_autoregressive(10_000)
        assert c.next_leg()[0].probe
        c.observe_round(bad())
        leg, switch = c.next_leg()
        assert switch == Decision(AR, LOW_ACCEPTANCE) and leg == Leg(AR, expected_wait)


def test_hysteresis_a_probe_just_above_the_bar_does_not_return():
    # Acceptance 0.625 stays speculating (>= 0.6) but does not come back (< 0.6 x 1.1 = 0.66).
    borderline = Round(committed=6, drafted=8, accepted=5, seconds=None)
    c = controller()
    for _ in range(4):
        c.observe_round(borderline)
    assert c.next_leg()[1] is None
    fall_back_on_low_acceptance(controller())
    c2 = controller()
    fall_back_on_low_acceptance(c2)
    c2.observe_autoregressive(32)
    assert c2.next_leg()[0].probe
    c2.observe_round(borderline)
    assert c2.next_leg()[1] == Decision(AR, LOW_ACCEPTANCE)


def test_draft_outage_reprobes_only_when_the_draft_may_be_used():
    allowed = [False]
    c = controller(can_speculate=lambda: allowed[0])
    assert c.fall_back(DRAFT_UNAVAILABLE) == Decision(AR, DRAFT_UNAVAILABLE)
    c.observe_autoregressive(32)
    assert c.next_leg() == (Leg(AR, 1), None)  # breaker open: keep decoding, ask again soon
    allowed[0] = True
    leg, switch = c.next_leg()
    assert leg.probe and switch == Decision(SPEC)


def test_fixed_reasons_never_reprobe():
    for reason in (SPECULATION_OFF, HIGH_TEMPERATURE, SEEDED):
        c = controller(start=Decision(AR, reason))
        c.observe_autoregressive(10_000)
        assert c.next_leg() == (Leg(AR, 0), None)  # one unbounded Generate


def test_speculation_on_is_never_switched_by_measurement():
    c = controller(adaptive=False)
    for _ in range(20):
        c.observe_round(bad())
    assert c.next_leg() == (Leg(SPEC, 0), None)  # one unbounded Speculate


def test_disabled_adaptive_still_returns_after_a_draft_outage():
    c = controller(config=AdaptiveConfig(enabled=False, reprobe_after_tokens=4))
    c.fall_back(DRAFT_UNAVAILABLE)
    c.observe_autoregressive(4)
    leg, switch = c.next_leg()
    assert leg.probe and switch == Decision(SPEC)
    c.observe_round(bad())
    assert c.next_leg() == (Leg(SPEC, 0), None)


def test_under_load_speculation_is_weighed_against_every_session_decoding():
    """Eight sessions speculating at 42 ms a token, in passes of 65 ms. A step of eight decoding
    sessions takes 23 ms: speculation costs them all. Weighed against the verification pass (a target
    that prices no step), speculation seemed to pay and every session kept it."""
    def after_warm_up(step_seconds: float):
        timer = StepTimer(alpha=1.0)
        c = SessionController(CONFIG, timer, Decision(SPEC), policy=SpeculationPolicy(), can_speculate=lambda: True,
                              load=lambda: 8)
        c.next_leg()
        for _ in range(4):
            timer.observe_verify(0.065, 8, step_seconds)
            c.observe_round(Round(committed=4, drafted=4, accepted=3, seconds=0.168))
        return c.next_leg()[1]

    assert after_warm_up(0.023) == Decision(AR, SLOWER_THAN_AUTOREGRESSIVE)
    assert after_warm_up(0.0) is None


# ---- the circuit breaker -----------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_unreachable_opens_at_once_and_a_later_healthy_probe_half_opens():
    clock = Clock()
    breaker = DraftBreaker(BreakerConfig(failure_threshold=3, cooldown_s=2.0), clock)
    breaker.record_failure(DraftFailure.UNREACHABLE)
    assert breaker.state is BreakerState.OPEN and not breaker.allows_speculation
    clock.now += 1.0
    breaker.probe(True)
    assert breaker.state is BreakerState.OPEN  # cooling down
    clock.now += 1.0
    breaker.probe(True)
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows_speculation
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED


def test_plain_failures_open_only_after_the_threshold_in_a_row():
    breaker = DraftBreaker(BreakerConfig(failure_threshold=3), Clock())
    breaker.record_failure(DraftFailure.FAILED)
    breaker.record_failure(DraftFailure.FAILED)
    breaker.record_success()
    breaker.record_failure(DraftFailure.FAILED)
    breaker.record_failure(DraftFailure.FAILED)
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure(DraftFailure.FAILED)
    assert breaker.state is BreakerState.OPEN


def test_a_draft_that_was_only_seen_down_by_health_probes_is_tried_as_soon_as_it_serves():
    breaker = DraftBreaker(BreakerConfig(cooldown_s=2.0), Clock())
    breaker.probe(False)  # e.g. still loading when the gateway started
    assert breaker.state is BreakerState.OPEN
    breaker.probe(True)
    assert breaker.state is BreakerState.HALF_OPEN


def test_a_draft_still_loading_at_start_is_no_warning_but_a_draft_going_down_later_is(caplog):
    breaker = DraftBreaker(BreakerConfig(cooldown_s=0.0), Clock())
    with caplog.at_level(logging.INFO, logger="gateway.breaker"):
        breaker.probe(False)
        assert [r.levelno for r in caplog.records] == [logging.INFO] and "not serving yet" in caplog.text
        breaker.probe(True)
        breaker.record_success()
        caplog.clear()
        breaker.probe(False)
    assert breaker.state is BreakerState.OPEN
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "health check failed" in caplog.text


def test_a_failure_while_half_open_reopens_with_a_longer_cooldown():
    clock = Clock()
    breaker = DraftBreaker(BreakerConfig(cooldown_s=2.0, max_cooldown_s=3.0), clock)
    breaker.record_failure(DraftFailure.UNREACHABLE)
    assert breaker.state is BreakerState.OPEN
    clock.now += 2.0
    breaker.probe(True)
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record_failure(DraftFailure.STALLED)
    assert breaker.state is BreakerState.OPEN
    clock.now += 2.5
    breaker.probe(True)
    assert breaker.state is BreakerState.OPEN  # the cooldown grew to 3 s
    clock.now += 0.5
    breaker.probe(True)
    assert breaker.state is BreakerState.HALF_OPEN


def test_default_settings_keep_long_blocks_that_pay_though_most_drafts_fail():
    """With the default K (7) a block usually fails past its first drafts, yet pays when rounds are
    cheap: the default acceptance floor must not send such a session back to plain decoding."""
    from tandem.config import DEFAULT_K, GatewaySettings

    c = controller(step_s=0.027, config=AdaptiveConfig.from_settings(GatewaySettings()))
    for _ in range(8):  # 2 of 7 accepted + the target's token, 3 tokens in 33 ms
        c.observe_round(Round(committed=3, drafted=DEFAULT_K, accepted=2, seconds=0.033))
    assert c.stats().acceptance < 0.3
    assert c.next_leg()[1] is None
    for _ in range(8):  # a hopeless draft still falls back
        c.observe_round(Round(committed=1, drafted=DEFAULT_K, accepted=0, seconds=0.02))
    assert c.next_leg()[1] == Decision(AR, LOW_ACCEPTANCE)
