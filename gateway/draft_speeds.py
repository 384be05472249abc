"""Which drafts a speculative leg may go to: those that commit the most tokens per second for the
session's target.

A pool's drafts need not be alike. One may run beside the target (a prompt-lookup draft that pays
a loopback round trip per round) and another across a network (a learned draft that proposes
better but pays the hop every round); a loaded draft is slower than an idle one. Load alone sees
none of this. What the gateway can compare is what each leg delivered: its committed tokens over
its wall time from its first round on (a call's set-up and the draft's catch-up weigh on a short
leg far more than on a long one, and any draft pays them). So:

- each (draft, target) pair estimates its committed tokens per second as tokens per round over
  seconds per round, each averaged over its recent rounds with a half-life of its own: a round's
  time hardly depends on the prompt (the target's pass, the hop, the draft's proposal and load), so
  it is averaged briefly and follows a hop or a load that changed; tokens per round depend on how
  predictable each prompt is, so they are averaged over many prompts (per leg, one prompt's luck
  would decide where the next legs go), and a draft measured on few rounds has its tokens per
  round drawn towards those of every draft serving the target (``prior_rounds`` rounds' worth):
  until its own rounds outweigh that, the reliable part, the time of a round, decides;
- a leg may go to the drafts whose average is within ``tie`` of the best, and the pool's least-load
  rule (:meth:`gateway.pool.Pool.place`) picks among them, so equal drafts share the work as before;
- exploration: a draft not placed for this target in the last ``explore_every`` legs takes the
  next one (those never tried first), so a draft that was slow while loaded, or was restarted, is
  measured again; until ``known_legs`` of its legs are measured, after ``explore_every_new`` legs
  already (one leg of an unpredictable prompt must not keep a draft off for long); a draft placed
  but not measured yet is left out until its leg reports, so that concurrent sessions do not all
  pile onto a draft nothing is known about;
- a probe is short: a leg that goes to a draft measured slower than another (or not measured while
  another is) commits at most ``probe_tokens`` there (:meth:`DraftSpeeds.probe_budget`), and the
  rest of the request goes where the next placement says. A probe measures the round time, which
  decides, within a few rounds; a whole request on a draft across a slow hop (``speculation: "on"``
  makes a request one leg) cost what the probe is there to avoid.

A draft that refuses a target (not one of its ``--target-address``) is left out for that target
for ``refusal_ttl_s``.

Invariant: :meth:`DraftSpeeds.choose` returns a subset of the candidates, non-empty unless every
candidate refuses the target (every candidate while nothing is measured).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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
    refused_at: float | None = None  # when the draft last said the target is not one of its own

    def rate(self, pooled_tokens_per_round: float, prior_rounds: float) -> float | None:
        """Committed tokens per second, tokens per round drawn towards ``pooled_tokens_per_round``
        with the weight of ``prior_rounds`` rounds; None before a leg committed anything."""
        if not (self.tokens and self.seconds):
            return None
        tokens_per_round = (self.tokens + prior_rounds * pooled_tokens_per_round) / (self.token_rounds + prior_rounds)
        return tokens_per_round / (self.seconds / self.second_rounds)


class DraftSpeeds:
    def __init__(
        self,
        time_half_life_rounds: float = 32,
        quality_half_life_rounds: float = 256,
        prior_rounds: float = 64,
        tie: float = 0.05,
        explore_every: int = 16,
        explore_every_new: int = 4,
        known_legs: int = 8,
        probe_tokens: int = 16,
        refusal_ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``time_half_life_rounds`` / ``quality_half_life_rounds``: after how many newer rounds a
        round counts half in seconds per round / tokens per round; ``prior_rounds``: the weight, in
        rounds, of all the target's drafts' tokens per round in each one's; ``tie``: relative
        shortfall from the best rate within which drafts count as equally fast; ``explore_every``: legs for a
        target after which a draft not placed in them gets the next one, ``explore_every_new``
        instead while fewer than ``known_legs`` of its legs for the target are measured;
        ``probe_tokens``: what a leg on a draft that is not the fastest measured may commit there
        (0: the whole leg); ``refusal_ttl_s``: how long a draft that refused a target (not one of
        its own) is kept off it (its pool may grow)."""
        if not (time_half_life_rounds > 0 and quality_half_life_rounds > 0 and prior_rounds >= 0 and 0 <= tie < 1
                and 1 <= explore_every_new <= explore_every and known_legs >= 0 and probe_tokens >= 0):
            raise ValueError("need half-lives > 0, prior_rounds >= 0, 0 <= tie < 1, 1 <= explore_every_new <= explore_every "
                             "and known_legs, probe_tokens >= 0")
        self.time_half_life_rounds = time_half_life_rounds
        self.quality_half_life_rounds = quality_half_life_rounds
        self.prior_rounds = prior_rounds
        self.tie = tie
        self.explore_every = explore_every
        self.explore_every_new = explore_every_new
        self.known_legs = known_legs
        self.probe_tokens = probe_tokens
        self.refusal_ttl_s = refusal_ttl_s
        self._clock = clock
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._legs: dict[str, int] = {}  # legs placed per target
        self._probes: dict[str, set[str]] = {}  # per target: the drafts the last choice for it explores

    def choose(self, candidates: Sequence[M], target: str) -> list[M]:
        """The candidates a leg for a session on ``target`` may go to (see the module doc)."""
        self._probes.pop(target, None)
        candidates = [m for m in candidates if not self.refuses(m.address, target)]
        if len(candidates) <= 1:
            return candidates
        legs = self._legs.get(target, 0)
        pairs = {m.address: self._pairs.get((m.address, target), _Pair()) for m in candidates}
        pooled = self._pooled_tokens_per_round(target)
        rates = {m.address: rate for m in candidates
                 if (rate := pairs[m.address].rate(pooled, self.prior_rounds)) is not None}
        stale = [m for m in candidates if pairs[m.address].placed_at < 0
                 or legs - pairs[m.address].placed_at >= self._explore_after(pairs[m.address])]
        if stale:
            oldest = min(pairs[m.address].placed_at for m in stale)
            chosen = [m for m in stale if pairs[m.address].placed_at == oldest]
            passed_over = [rate for address, rate in rates.items() if all(m.address != address for m in chosen)]
            if passed_over:
                bar = max(passed_over) * (1 - self.tie)
                self._probes[target] = {m.address for m in chosen if rates.get(m.address, 0.0) < bar}
            return chosen
        if not rates:
            return list(candidates)
        best = max(rates.values())
        return [m for m in candidates if m.address in rates and rates[m.address] >= best * (1 - self.tie)]

    def probe_budget(self, draft: str, target: str) -> int:
        """What the leg just placed on ``draft`` for ``target`` (by the last :meth:`choose` for it)
        may commit there: ``probe_tokens`` where that choice was an exploration and one of the
        drafts it passed over measures faster (or measures while ``draft`` does not); else 0, no
        limit. Call it once, right after the placement (it forgets that choice)."""
        return self.probe_tokens if draft in self._probes.pop(target, ()) else 0

    def refused(self, draft: str, target: str) -> None:
        """``draft`` said ``target`` is not one of its targets: no legs for it there for a while."""
        self._pair(draft, target).refused_at = self._clock()

    def refuses(self, draft: str, target: str) -> bool:
        pair = self._pairs.get((draft, target))
        return (pair is not None and pair.refused_at is not None
                and self._clock() - pair.refused_at < self.refusal_ttl_s)

    def _explore_after(self, pair: _Pair) -> int:
        return self.explore_every if pair.legs >= self.known_legs else self.explore_every_new

    def placed(self, draft: str, target: str) -> None:
        """A leg for a session on ``target`` went to ``draft``."""
        legs = self._legs[target] = self._legs.get(target, 0) + 1
        self._pair(draft, target).placed_at = legs

    def observe(self, draft: str, target: str, tokens: int, rounds: int, seconds: float) -> None:
        """A leg on ``draft`` for a session on ``target`` committed ``tokens`` in ``rounds`` rounds
        and ``seconds`` (after its first round). Legs that failed are not reported."""
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
        """The committed tokens per second placement goes by (None: not measured)."""
        pair = self._pairs.get((draft, target))
        return None if pair is None else pair.rate(self._pooled_tokens_per_round(target), self.prior_rounds)

    def to_json(self, draft: str) -> dict[str, Any]:
        """For /health: the draft's measured committed tokens per second by target."""
        return {target: round(rate, 2) for (address, target) in list(self._pairs)
                if address == draft and (rate := self.rate(address, target)) is not None}

    def forget(self, address: str) -> None:
        """A draft or target left its pool: what was measured with it goes."""
        for key in [key for key in self._pairs if address in key]:
            del self._pairs[key]
        self._legs.pop(address, None)

    def _pooled_tokens_per_round(self, target: str) -> float:
        """Tokens per round over the recent rounds of every draft serving ``target`` (0: none yet)."""
        pairs = [pair for (_, t), pair in self._pairs.items() if t == target]
        rounds = sum(pair.token_rounds for pair in pairs)
        return sum(pair.tokens for pair in pairs) / rounds if rounds else 0.0

    def _pair(self, draft: str, target: str) -> _Pair:
        return self._pairs.setdefault((draft, target), _Pair())
