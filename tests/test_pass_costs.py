"""The target's pass cost by rows (``tandem.pass_costs``), which the draft's block policy and the
target's step estimate both read."""

from __future__ import annotations

import pytest

from tandem.pass_costs import COST_WINDOW, MIN_COST_SAMPLES, PassCosts


def test_pass_costs_are_medians_interpolated_between_known_sizes():
    costs = PassCosts()
    costs.observe(2, 1.0)  # an outlier: the median ignores it
    assert costs.estimate(2) is None  # fewer samples than MIN_COST_SAMPLES
    for seconds in (0.010, 0.011, 0.012, 0.013):
        costs.observe(2, seconds)
    for _ in range(MIN_COST_SAMPLES):
        costs.observe(6, 0.030)
    assert costs.estimate(2) == pytest.approx(0.012)
    assert costs.estimate(4) == pytest.approx(0.012 + 0.5 * (0.030 - 0.012))
    assert costs.estimate(1) == pytest.approx(0.012)  # below every known size: the nearest
    assert costs.estimate(8) == pytest.approx(0.030 + 2 * (0.030 - 0.012) / 4)  # past the largest: its slope
    for _ in range(MIN_COST_SAMPLES):
        costs.observe(9, 0.020)  # a wider pass measured cheaper (noise): never extrapolated downwards
    assert costs.estimate(12) == pytest.approx(0.020)


def test_a_size_is_priced_by_its_recent_passes():
    costs = PassCosts()
    for _ in range(COST_WINDOW):
        costs.observe(4, 0.050)  # a slow spell ...
    for _ in range(COST_WINDOW // 2 + 1):
        costs.observe(4, 0.020)  # ... then the host is quiet again: the median follows within half a window
    assert costs.estimate(4) == pytest.approx(0.020)
    assert costs.medians() == {4: pytest.approx(0.020)}
