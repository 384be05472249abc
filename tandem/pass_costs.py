"""What a forward pass of the target costs by its rows, learned from passes as they run.

On a CPU a pass over a few rows costs about what one row does (it reads the weights once), and
past some width the arithmetic takes over; where that happens depends on the host and the model.
Both sides of a speculative round need the curve: the draft prices a block's drafts against the
pass they widen (``draft_service.block_length``), and the target names, beside each answer, what a
pass would cost in which every session decodes one token (``target_service.engine``), the step
the gateway weighs speculation against. Measured sizes give their medians (noise included: a
wider pass may measure cheaper); past the widest measured, an estimate never falls as rows grow.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

COST_WINDOW = 48  # passes remembered per size
MIN_COST_SAMPLES = 3  # passes of a size before its median counts


@dataclass
class PassCosts:
    """Recent seconds per pass size (rows), as medians over a window per size."""

    window: int = COST_WINDOW
    _samples: dict[int, deque[float]] = field(default_factory=dict)
    _medians: dict[int, float] = field(default_factory=dict)  # sizes with MIN_COST_SAMPLES or more

    def observe(self, rows: int, seconds: float) -> None:
        samples = self._samples.setdefault(rows, deque(maxlen=self.window))
        samples.append(seconds)
        if len(samples) >= MIN_COST_SAMPLES:
            self._medians[rows] = statistics.median(samples)

    def medians(self) -> dict[int, float]:
        return dict(sorted(self._medians.items()))

    def estimate(self, rows: float, medians: dict[int, float] | None = None) -> float | None:
        """The median for ``rows``, else interpolated between the nearest known sizes; below the
        smallest, the smallest's; past the largest, on along the slope of the two largest (never
        down: a pass does not get cheaper with rows); None before any size is known."""
        known = self._medians if medians is None else medians
        if not known:
            return None
        if rows in known:
            return known[rows]
        below = max((r for r in known if r < rows), default=None)
        above = min((r for r in known if r > rows), default=None)
        if below is None:
            return known[above]
        if above is None:
            sizes = sorted(known)
            if len(sizes) < 2:
                return known[below]
            a, b = sizes[-2], sizes[-1]
            return known[b] + max(0.0, (known[b] - known[a]) / (b - a)) * (rows - b)
        weight = (rows - below) / (above - below)
        return known[below] + weight * (known[above] - known[below])
