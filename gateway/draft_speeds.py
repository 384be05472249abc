"""Which drafts a speculative leg may go to: those that commit the most tokens per second for the
session's target.

A pool's drafts need not be alike. One may run beside the target (a prompt-lookup draft that pays
a loopback round trip per round) and another across a network (a learned draft that proposes
better but pays the hop every round); a loaded draft is slower than an idle one. Load alone sees
none of this. What the gateway can compare is what each leg delivered: its committed tokens over
its wall time, call set-up and the draft's own catch-up included (a leg placed elsewhere pays
those too). So:

- each (draft, target) pair keeps an exponential average of its legs' committed tokens per second;
- a leg may go to the drafts whose average is within ``tie`` of the best, and the pool's least-load
  rule (:meth:`gateway.pool.Pool.place`) picks among them, so equal drafts share the work as before;
- exploration: a draft not placed for this target in the last ``explore_every`` legs takes the
  next one (those never tried first), so a draft that was slow while loaded, or was restarted, is
  measured again; a draft placed but not measured yet is left out until its leg reports, so that
  concurrent sessions do not all pile onto a draft nothing is known about.

Invariant: :meth:`DraftSpeeds.choose` returns a non-empty subset of a non-empty candidate list
(every candidate while nothing is measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar


class _Addressed(Protocol):
    address: str


M = TypeVar("M", bound=_Addressed)


@dataclass
class _Pair:
    """One draft serving one target."""

    rate: float | None = None  # committed tokens per second, exponential average over legs
    legs: int = 0  # legs measured
    placed_at: int = -1  # the target's leg count when a leg last went here (-1: never)


class DraftSpeeds:
    def __init__(self, alpha: float = 0.2, tie: float = 0.05, explore_every: int = 16) -> None:
        """``alpha``: weight of a new leg in the average; ``tie``: relative shortfall from the best
        rate within which drafts count as equally fast; ``explore_every``: legs for a target after
        which a draft not placed in them gets the next one."""
        if not (0 < alpha <= 1 and 0 <= tie < 1 and explore_every >= 1):
            raise ValueError("need 0 < alpha <= 1, 0 <= tie < 1 and explore_every >= 1")
        self.alpha = alpha
        self.tie = tie
        self.explore_every = explore_every
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._legs: dict[str, int] = {}  # legs placed per target

    def choose(self, candidates: Sequence[M], target: str) -> list[M]:
        """The candidates a leg for a session on ``target`` may go to (see the module doc)."""
        if len(candidates) <= 1:
            return list(candidates)
        legs = self._legs.get(target, 0)
        pairs = {m.address: self._pairs.get((m.address, target), _Pair()) for m in candidates}
        stale = [m for m in candidates
                 if pairs[m.address].placed_at < 0 or legs - pairs[m.address].placed_at >= self.explore_every]
        if stale:
            oldest = min(pairs[m.address].placed_at for m in stale)
            return [m for m in stale if pairs[m.address].placed_at == oldest]
        rated = [m for m in candidates if pairs[m.address].rate is not None]
        if not rated:
            return list(candidates)
        best = max(pairs[m.address].rate or 0.0 for m in rated)
        return [m for m in rated if (pairs[m.address].rate or 0.0) >= best * (1 - self.tie)]

    def placed(self, draft: str, target: str) -> None:
        """A leg for a session on ``target`` went to ``draft``."""
        legs = self._legs[target] = self._legs.get(target, 0) + 1
        self._pair(draft, target).placed_at = legs

    def observe(self, draft: str, target: str, tokens: int, seconds: float) -> None:
        """A leg on ``draft`` for a session on ``target`` committed ``tokens`` in ``seconds``, all
        of its wall time. Legs that failed or were cut short are not reported."""
        if tokens <= 0 or seconds <= 0:
            return
        pair = self._pair(draft, target)
        rate = tokens / seconds
        pair.rate = rate if pair.rate is None else self.alpha * rate + (1 - self.alpha) * pair.rate
        pair.legs += 1

    def rate(self, draft: str, target: str) -> float | None:
        pair = self._pairs.get((draft, target))
        return None if pair is None else pair.rate

    def to_json(self, draft: str) -> dict[str, Any]:
        """For /health: the draft's measured committed tokens per second by target."""
        return {target: round(pair.rate, 2) for (address, target), pair in self._pairs.items()
                if address == draft and pair.rate is not None}

    def _pair(self, draft: str, target: str) -> _Pair:
        return self._pairs.setdefault((draft, target), _Pair())
