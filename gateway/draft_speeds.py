"""Which drafts a speculative leg may go to: those that commit the most tokens per second for the
session's target.

A pool's drafts need not be alike. One may run beside the target (a prompt-lookup draft that pays
a loopback round trip per round) and another across a network (a learned draft that proposes
better but pays the hop every round); a loaded draft is slower than an idle one. Load alone sees
none of this. What the gateway can compare is what each leg delivered: its committed tokens over
its wall time, call set-up and the draft's own catch-up included (a leg placed elsewhere pays
those too). So:

- each (draft, target) pair estimates its committed tokens per second as tokens per round over
  seconds per round, each averaged over its recent rounds with a half-life of its own: a round's
  time hardly depends on the prompt (the target's pass, the hop, the draft's proposal and load), so
  it is averaged briefly and follows a hop or a load that changed; tokens per round depend on how
  predictable each prompt is, so they are averaged over many prompts (per leg, one prompt's luck
  would decide where the next legs go);
- a leg may go to the drafts whose average is within ``tie`` of the best, and the pool's least-load
  rule (:meth:`gateway.pool.Pool.place`) picks among them, so equal drafts share the work as before;
- exploration: a draft not placed for this target in the last ``explore_every`` legs takes the
  next one (those never tried first), so a draft that was slow while loaded, or was restarted, is
  measured again; until ``known_legs`` of its legs are measured, after ``explore_every_new`` legs
  already (one leg of an unpredictable prompt must not keep a draft off for long); a draft placed
  but not measured yet is left out until its leg reports, so that concurrent sessions do not all
  pile onto a draft nothing is known about.

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
    """One draft serving one target: sums over its rounds, each older round weighing less."""

    tokens: float = 0.0  # committed tokens ...
    token_rounds: float = 0.0  # ... over these rounds (the quality half-life)
    seconds: float = 0.0  # wall time ...
    second_rounds: float = 0.0  # ... over these rounds (the time half-life)
    legs: int = 0  # legs measured
    placed_at: int = -1  # the target's leg count when a leg last went here (-1: never)

    @property
    def rate(self) -> float | None:
        """Committed tokens per second; None before a leg committed anything."""
        if not (self.tokens and self.seconds):
            return None
        return (self.tokens / self.token_rounds) / (self.seconds / self.second_rounds)


class DraftSpeeds:
    def __init__(self, time_half_life_rounds: float = 32, quality_half_life_rounds: float = 256,
                 tie: float = 0.05, explore_every: int = 16, explore_every_new: int = 4, known_legs: int = 8) -> None:
        """``time_half_life_rounds`` / ``quality_half_life_rounds``: after how many newer rounds a
        round counts half in seconds per round / tokens per round; ``tie``: relative shortfall from
        the best rate within which drafts count as equally fast; ``explore_every``: legs for a
        target after which a draft not placed in them gets the next one, ``explore_every_new``
        instead while fewer than ``known_legs`` of its legs for the target are measured."""
        if not (time_half_life_rounds > 0 and quality_half_life_rounds > 0 and 0 <= tie < 1
                and 1 <= explore_every_new <= explore_every and known_legs >= 0):
            raise ValueError("need half-lives > 0, 0 <= tie < 1, 1 <= explore_every_new <= explore_every "
                             "and known_legs >= 0")
        self.time_half_life_rounds = time_half_life_rounds
        self.quality_half_life_rounds = quality_half_life_rounds
        self.tie = tie
        self.explore_every = explore_every
        self.explore_every_new = explore_every_new
        self.known_legs = known_legs
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._legs: dict[str, int] = {}  # legs placed per target

    def choose(self, candidates: Sequence[M], target: str) -> list[M]:
        """The candidates a leg for a session on ``target`` may go to (see the module doc)."""
        if len(candidates) <= 1:
            return list(candidates)
        legs = self._legs.get(target, 0)
        pairs = {m.address: self._pairs.get((m.address, target), _Pair()) for m in candidates}
        stale = [m for m in candidates if pairs[m.address].placed_at < 0
                 or legs - pairs[m.address].placed_at >= self._explore_after(pairs[m.address])]
        if stale:
            oldest = min(pairs[m.address].placed_at for m in stale)
            return [m for m in stale if pairs[m.address].placed_at == oldest]
        rates = {m.address: rate for m in candidates if (rate := pairs[m.address].rate) is not None}
        if not rates:
            return list(candidates)
        best = max(rates.values())
        return [m for m in candidates if m.address in rates and rates[m.address] >= best * (1 - self.tie)]

    def _explore_after(self, pair: _Pair) -> int:
        return self.explore_every if pair.legs >= self.known_legs else self.explore_every_new

    def placed(self, draft: str, target: str) -> None:
        """A leg for a session on ``target`` went to ``draft``."""
        legs = self._legs[target] = self._legs.get(target, 0) + 1
        self._pair(draft, target).placed_at = legs

    def observe(self, draft: str, target: str, tokens: int, rounds: int, seconds: float) -> None:
        """A leg on ``draft`` for a session on ``target`` committed ``tokens`` in ``rounds`` rounds
        and ``seconds``, all of its wall time. Legs that failed are not reported."""
        if tokens <= 0 or rounds <= 0 or seconds <= 0:
            return
        pair = self._pair(draft, target)
        keep_time = 0.5 ** (rounds / self.time_half_life_rounds)
        keep_quality = 0.5 ** (rounds / self.quality_half_life_rounds)
        pair.seconds = pair.seconds * keep_time + seconds
        pair.second_rounds = pair.second_rounds * keep_time + rounds
        pair.tokens = pair.tokens * keep_quality + tokens
        pair.token_rounds = pair.token_rounds * keep_quality + rounds
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
