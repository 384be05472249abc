"""What the hop to one target costs, and whether a block sent ahead of a verdict pays for itself.

A block sent before the verdict of the one before it (``draft_service.pipeline``) saves, when its
assumption holds, the round trip and the proposal that would have followed the verdict; it costs
a proposal whether it holds or not: draft work that, on a host where draft and target share cores,
slows the target's pass too. So the pipelined loop sends one ahead only where that pays on average:

    hold_rate * (transport + propose) > propose

- ``transport``: the round trip beyond the target's pass (a verdict's arrival minus the block's
  sending, minus the ``verify_seconds`` the target reports), median over the last blocks sent
  with nothing in flight before them (a block queued behind another's pass would count that pass);
- ``hold_rate``: the share of blocks sent ahead whose assumption held, starting from a prior, per
  rank among the blocks sent on the same block before them (hedges: rank 0 assumes its most likely
  outcome, rank 1 the next, ...; their outcomes exclude each other, so each is priced alone);
- ``propose``: the median seconds a proposal took: on a verdict (what a block that held spares),
  and ahead of one (what each block sent ahead costs; the head's rollout included).

Over loopback the transport is a fraction of a millisecond on idle cores (about 2 ms where draft
and target share two cores: the wait for a core), and nothing is sent ahead; across a slow link
blocks are, and the loop keeps them in flight. Where draft and target run on separate
hardware a proposal ahead does not slow the target, and ``--pipeline-ahead always`` sends every
block ahead that the depth and hedges allow. One ``HopStats`` per target, shared by the
sessions on it: the hop is the target's, not the session's. Every ``EXPLORE_EVERY``-th chance
goes ahead regardless, so the hold rate stays measured where the rule says no, but only where an
optimistic hold rate (the estimate plus two standard errors) would pay: a block that rarely holds
is explored until that is known, and again when the hop grows enough for it to pay.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

WINDOW = 64  # recent measurements each median is over
TRANSPORT_WINDOW = 16  # ... but the hop's: a link that slows down is followed within a few rounds
PRIOR_HOLD = 0.25  # the hold rate a fresh service assumes ...
PRIOR_WEIGHT = 4.0  # ... as if it had seen this many blocks sent ahead
EXPLORE_EVERY = 16


class HopStats:
    def __init__(self, always: bool = False) -> None:
        """``always``: every chance goes ahead (``--pipeline-ahead always``: draft work off the
        target's hardware costs the target nothing); the measurements are kept all the same."""
        self._always = always
        self._transport: deque[float] = deque(maxlen=TRANSPORT_WINDOW)
        self._propose: deque[float] = deque(maxlen=WINDOW)
        self._ahead_propose: deque[float] = deque(maxlen=WINDOW)
        self._held: dict[int, int] = {}  # by rank
        self._judged: dict[int, int] = {}
        self._chances = 0

    def observe_transport(self, seconds: float) -> None:
        self._transport.append(max(0.0, seconds))

    def observe_exchange(self, seconds: float, verify_seconds: float) -> None:
        """A block's ``seconds`` from sending to verdict, of which the target's pass took
        ``verify_seconds`` (a target that reports no pass time tells nothing about the hop)."""
        if verify_seconds > 0:
            self.observe_transport(seconds - verify_seconds)

    def observe_propose(self, seconds: float, ahead: bool) -> None:
        (self._ahead_propose if ahead else self._propose).append(max(0.0, seconds))

    def observe_ahead(self, held: bool, rank: int = 0) -> None:
        self._held[rank] = self._held.get(rank, 0) + held
        self._judged[rank] = self._judged.get(rank, 0) + 1

    @property
    def transport_s(self) -> float:
        return statistics.median(self._transport) if self._transport else 0.0

    @property
    def measured_transport_s(self) -> float | None:
        return self.transport_s if self._transport else None

    @property
    def propose_s(self) -> float:
        times = self._ahead_propose or self._propose
        return statistics.median(times) if times else 0.0

    @property
    def plain_propose_s(self) -> float:
        """The median proposal on a verdict (what a block that held spared)."""
        return statistics.median(self._propose) if self._propose else 0.0

    def hold_rate(self, rank: int = 0) -> float:
        prior = PRIOR_HOLD / (rank + 1)
        return (self._held.get(rank, 0) + prior * PRIOR_WEIGHT) / (self._judged.get(rank, 0) + PRIOR_WEIGHT)

    def hold_bound(self, rank: int = 0) -> float:
        """An optimistic hold rate: the estimate plus two binomial standard errors over the blocks
        judged and the prior's weight. Where even this rate would not pay, exploring is waste."""
        rate = self.hold_rate(rank)
        judged = self._judged.get(rank, 0) + PRIOR_WEIGHT
        return min(1.0, rate + 2.0 * math.sqrt(rate * (1.0 - rate) / judged))

    def send_ahead(self, rank: int = 0) -> bool:
        """Whether a block of this rank goes out before the verdict it depends on (see the module
        doc); every ``EXPLORE_EVERY``-th chance of a rank goes regardless where its optimistic hold
        rate (``hold_bound``) would pay."""
        if self._always:
            return True
        saving = self.transport_s + self.plain_propose_s  # what a block that holds spares
        if saving <= self.propose_s:
            return False  # not even a block sure to hold would pay: nothing to explore
        self._chances += rank == 0
        if self.hold_rate(rank) * saving > self.propose_s:
            return True
        return self._chances % EXPLORE_EVERY == 0 and self.hold_bound(rank) * saving > self.propose_s
