"""Token trees or chains: whichever commits more tokens per second of round on this host.

A token tree (``ngram+eagle``'s greedy blocks where lookup has no strong match) commits more tokens
a round than a chain, for a wider verification pass and a few more head steps. Whether that pays is
the host's to say: where a pass over six rows costs little more than one over four (int8 products
on AVX-512 VNNI) trees pay; where the LM head's product turns compute-bound with the rows (the same
products on AVX2) chains do (figures: docs/drafting.md#tree-nodes). A probe of the CPU would
guess; the rounds themselves say it exactly, with the drafter, the text and the hop included. So the draft service measures both shapes as it serves and drafts the one
that commits more tokens per second of round:

    rate(shape) = sum of tokens committed / sum of (propose + send-to-verdict seconds)

over the last ``WINDOW`` rounds of each shape in which this choice was made (rounds where lookup
copies a strong match are chains either way and do not count). Until each shape has
``MIN_ROUNDS``, the shapes alternate; then the faster one drafts and every ``EXPLORE_EVERY``-th
choice goes to the other, so a change of load or of text can turn the choice back. Once a shape
leads, the other takes over only when it measures ``MARGIN`` faster: where both pay alike (as on
a host whose wide passes cost little more than narrow ones) the choice does not flap with the noise.

The choice changes which drafts a block carries, never what the target commits: greedy output is
the target's under either shape. One instance per draft service (its host and its target's),
shared by every session: ``choose`` runs on the model thread, ``observe`` on the event loop, so
the tallies sit behind a lock.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

TREE = "tree"
CHAIN = "chain"
SHAPES = (TREE, CHAIN)
WINDOW = 256  # rounds of each shape the rate is taken over
MIN_ROUNDS = 24  # rounds of each shape before the rates decide
EXPLORE_EVERY = 16  # every so many choices go to the shape measured slower
MARGIN = 0.03  # how much faster the other shape must measure to take the lead


@dataclass
class _Tally:
    """Tokens and seconds of a shape's last rounds, with their running sums."""

    window: int
    rounds: deque[tuple[int, float]] = field(default_factory=deque)
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.rounds.append((tokens, seconds))
        self.tokens += tokens
        self.seconds += seconds
        if len(self.rounds) > self.window:
            old_tokens, old_seconds = self.rounds.popleft()
            self.tokens -= old_tokens
            self.seconds -= old_seconds

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.rounds and self.seconds > 0 else None


class BlockShapes:
    """Chooses the shape of the next block where a tree could be drafted, from measured rates."""

    def __init__(
        self, name: str = "", window: int = WINDOW, min_rounds: int = MIN_ROUNDS, explore_every: int = EXPLORE_EVERY
    ) -> None:
        """``name``: whose rounds these are ("greedy", "sampled"), for the log."""
        if window < 1 or min_rounds < 1 or explore_every < 0:
            raise ValueError("window and min_rounds must be >= 1, explore_every >= 0")
        self.name = name
        self._tallies = {shape: _Tally(window) for shape in SHAPES}
        self._min_rounds = min(min_rounds, window)
        self._explore_every = explore_every
        self._choices = 0
        self._leader: str | None = None  # the shape that drafts (None while learning)
        self._lock = threading.Lock()

    def choose(self) -> str:
        """TREE or CHAIN for the next block that could be either."""
        with self._lock:
            counts = {shape: len(tally.rounds) for shape, tally in self._tallies.items()}
            if min(counts.values()) < self._min_rounds:
                return TREE if counts[TREE] <= counts[CHAIN] else CHAIN  # alternate while learning
            rates = {shape: tally.rate or 0.0 for shape, tally in self._tallies.items()}
            if self._leader is None:
                self._lead(TREE if rates[TREE] >= rates[CHAIN] else CHAIN, rates, counts)
            elif rates[_other(self._leader)] > rates[self._leader] * (1 + MARGIN):
                self._lead(_other(self._leader), rates, counts)
            leader = self._leader
            self._choices += 1
            if self._explore_every and self._choices % self._explore_every == 0:
                return _other(leader)
            return leader

    def _lead(self, shape: str, rates: dict[str, float], counts: dict[str, int]) -> None:
        self._leader = shape
        other = _other(shape)
        log.info("block shape%s: %ss (%.1f tokens/s of round) over %ss (%.1f), from the last %d and %d rounds",
                 f" of {self.name} sessions" if self.name else "", shape, rates[shape], other, rates[other],
                 counts[shape], counts[other])

    def observe(self, shape: str, tokens: int, seconds: float) -> None:
        """A verified round of ``shape`` (as chosen) committed ``tokens`` in ``seconds`` (proposing
        included). Rounds whose time is not their own (a block sent while another was in flight)
        are not to be reported."""
        if shape not in self._tallies:
            raise ValueError(f"unknown block shape {shape!r}")
        if seconds <= 0 or tokens < 0:
            return
        with self._lock:
            self._tallies[shape].add(tokens, seconds)

    def rates(self) -> dict[str, float | None]:
        """Measured tokens per second of round of each shape (None before any round)."""
        with self._lock:
            return {shape: tally.rate for shape, tally in self._tallies.items()}


def _other(shape: str) -> str:
    return CHAIN if shape == TREE else TREE
