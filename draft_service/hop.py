"""What the hop to one target costs, and whether a block sent ahead of a verdict pays for itself.

A block sent before the verdict of the one before it (``draft_service.pipeline``) saves the round
trip when its assumption holds, and costs a proposal whether it holds or not: draft work that, on
a host where draft and target share cores, slows the target's pass too. So the pipelined loop
sends one ahead only where that pays on average:

    hold_rate * transport > propose

- ``transport``: the round trip beyond the target's pass (a verdict's arrival minus the block's
  sending, minus the ``verify_seconds`` the target reports), median over the last blocks sent
  with nothing in flight before them (a block queued behind another's pass would count that pass);
- ``hold_rate``: the share of blocks sent ahead whose assumption held, starting from a prior;
- ``propose``: the median seconds a proposal ahead took (the head's rollout included).

Over loopback the transport is a fraction of a millisecond and nothing is sent ahead; across a
slow link it is, and the loop keeps blocks in flight. One ``HopStats`` per target, shared by the
sessions on it: the hop is the target's, not the session's. Every ``EXPLORE_EVERY``-th chance
goes ahead regardless, so the hold rate stays measured where the rule says no.
"""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 64  # recent measurements each median is over
PRIOR_HOLD = 0.25  # the hold rate a fresh service assumes ...
PRIOR_WEIGHT = 4.0  # ... as if it had seen this many blocks sent ahead
EXPLORE_EVERY = 16


class HopStats:
    def __init__(self) -> None:
        self._transport: deque[float] = deque(maxlen=WINDOW)
        self._propose: deque[float] = deque(maxlen=WINDOW)
        self._ahead_propose: deque[float] = deque(maxlen=WINDOW)
        self._held = 0
        self._judged = 0
        self._chances = 0

    def observe_transport(self, seconds: float) -> None:
        self._transport.append(max(0.0, seconds))

    def observe_propose(self, seconds: float, ahead: bool) -> None:
        (self._ahead_propose if ahead else self._propose).append(max(0.0, seconds))

    def observe_ahead(self, held: bool) -> None:
        self._held += held
        self._judged += 1

    @property
    def transport_s(self) -> float:
        return statistics.median(self._transport) if self._transport else 0.0

    @property
    def propose_s(self) -> float:
        times = self._ahead_propose or self._propose
        return statistics.median(times) if times else 0.0

    @property
    def hold_rate(self) -> float:
        return (self._held + PRIOR_HOLD * PRIOR_WEIGHT) / (self._judged + PRIOR_WEIGHT)

    def send_ahead(self) -> bool:
        """Whether the next block goes out before the verdict it depends on (see the module doc)."""
        self._chances += 1
        if self._chances % EXPLORE_EVERY == 0:
            return True
        return self.hold_rate * self.transport_s > self.propose_s
