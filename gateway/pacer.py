"""Stream smoothing: a per-session pacer that turns bursts of verified tokens into an even cadence.

Speculative decoding commits 1 to K+1 tokens per round, so a raw stream stutters: a burst, a
pause of one round, a burst. The pacer gives every token a release time spaced by the recent
verified-token rate: the time the last ``rate_window`` upstream batches took over the tokens they
brought, so a short round (1 token) and a long one (K+1) average out instead of each setting the
cadence on its own. A rate over many rounds rather than the median of per-batch rates: replayed on
live rounds (``benchmarks/pacer_replay.py``), the per-batch median tracks each burst, empties the
queue after every long round and leaves a pause of a whole round before the next one; the windowed
rate keeps a few tokens queued across short rounds. Each gap counts at most ``gap_clip`` median
gaps, so one slow round (a leg boundary, a GC pause) does not stretch the cadence of the next ones.

A token is held at most two rounds by default: within one round the arrivals themselves, not the
estimator, keep the jitter up (replays and figures: docs/streaming.md#stream-smoothing). The
end-to-end latency stays (the flush below), and so does the time to the first token, which no
estimate exists for yet and which is never held.

Guarantees, whatever the estimate says:

* order: tokens leave in the order they arrived (one FIFO queue, release times never decrease);
* nothing is dropped or invented: every pushed item is released exactly once;
* bounded delay: no token waits longer than ``max_delay_rounds`` round times (and at most
  ``max_delay_s``) after it arrived; when a new estimate shrinks the bound, queued tokens are
  pulled forward rather than overtaken;
* flush: at the end of the stream everything still queued leaves at once, so the end-to-end
  latency is not stretched by pacing.

:class:`Pacer` is pure (no asyncio, the caller passes ``now``) so it is tested with a fake clock;
:func:`paced` drives it from an async source of batches.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
F = TypeVar("F")


@dataclass(frozen=True)
class PacerConfig:
    # Upper bound of a token's extra delay, in round times (inter-batch gaps) ...
    max_delay_rounds: float = 2.0
    # ... and in seconds, whichever is smaller.
    max_delay_s: float = 0.5
    # Upstream batches the round time (the typical gap, for the bound) looks back over.
    window: int = 8
    # Upstream batches the token rate looks back over (a longer window is smoother) ...
    rate_window: int = 16
    # ... each gap counted as at most this many median gaps.
    gap_clip: float = 1.5


class _Estimate:
    """The round time (median recent gap between upstream batches) and the token rate over a
    longer window (clipped gaps summed over tokens)."""

    def __init__(self, config: PacerConfig) -> None:
        self._window = config.window
        self._clip = config.gap_clip
        self._batches: deque[tuple[float, int]] = deque(maxlen=max(config.window, config.rate_window))
        self._rate_window = config.rate_window

    def update(self, gap_s: float, tokens: int) -> None:
        self._batches.append((gap_s, tokens))

    @property
    def gap_s(self) -> float | None:
        """The round time: the typical gap between upstream batches (None before any)."""
        if not self._batches:
            return None
        return statistics.median(gap for gap, _ in list(self._batches)[-self._window:])

    @property
    def interval_s(self) -> float:
        """Seconds between two tokens at the recent verified-token rate (0 before any estimate)."""
        round_s = self.gap_s
        if round_s is None:
            return 0.0
        recent = list(self._batches)[-self._rate_window:]
        cap = self._clip * round_s
        return sum(min(gap, cap) for gap, _ in recent) / sum(tokens for _, tokens in recent)


class Pacer(Generic[T]):
    """Assigns release times to items (one per token) pushed in batches; see the module doc."""

    def __init__(self, config: PacerConfig = PacerConfig()) -> None:
        self.config = config
        self._estimate = _Estimate(config)
        self._queue: deque[tuple[float, T]] = deque()
        self._last_arrival: float | None = None
        self._last_release = -math.inf

    def push(self, items: Sequence[T], now: float) -> None:
        """Queues one upstream batch that arrived at ``now``."""
        if not items:
            return
        if self._last_arrival is not None:
            self._estimate.update(max(0.0, now - self._last_arrival), len(items))
        self._last_arrival = now
        interval = self._estimate.interval_s
        latest = now + self.max_delay_s
        self._pull_forward(latest)
        first = min(max(now, self._last_release + interval), latest)
        # A batch larger than usual would overrun the bound at the usual cadence: spread it over
        # the time left instead of releasing its tail in one burst at the bound.
        step = interval
        if len(items) > 1 and first + step * (len(items) - 1) > latest:
            step = (latest - first) / (len(items) - 1)
        for index, item in enumerate(items):
            release = first + step * index
            self._queue.append((release, item))
            self._last_release = release

    @property
    def max_delay_s(self) -> float:
        """The current bound on a token's extra delay (0 until a round time has been measured)."""
        round_s = self._estimate.gap_s
        if round_s is None:
            return 0.0
        return min(self.config.max_delay_s, self.config.max_delay_rounds * round_s)

    def due(self, now: float) -> list[T]:
        """Pops the items whose release time has come, in order."""
        out: list[T] = []
        while self._queue and self._queue[0][0] <= now:
            out.append(self._queue.popleft()[1])
        return out

    def flush(self) -> list[T]:
        """Pops everything queued (the stream ended)."""
        out = [item for _, item in self._queue]
        self._queue.clear()
        return out

    def next_release(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def __len__(self) -> int:
        return len(self._queue)

    def _pull_forward(self, latest: float) -> None:
        """Caps queued release times at ``latest`` so that a new item never waits beyond its
        bound behind an older one (release times stay non-decreasing)."""
        if self._last_release <= latest:
            return
        self._queue = deque((min(release, latest), item) for release, item in self._queue)
        self._last_release = latest


# ---- the async driver ---------------------------------------------------------------------------

Clock = Callable[[], float]
# Waits until ``task`` is done or ``timeout`` seconds passed (None: no limit); True when done.
Waiter = Callable[[asyncio.Future, "float | None"], Awaitable[bool]]


async def wait_for_task(task: asyncio.Future, timeout: float | None) -> bool:
    done, _ = await asyncio.wait({task}, timeout=timeout)
    return bool(done)


async def paced(
    source: AsyncIterator[Sequence[T] | F],
    pacer: Pacer[T],
    is_batch: Callable[[object], bool],
    clock: Clock,
    wait: Waiter = wait_for_task,
) -> AsyncIterator[T | F]:
    """Re-times ``source``: batches (``is_batch``) are spread out by ``pacer``; anything else (the
    final event) flushes the queue and passes through. The source is read ahead while tokens
    wait, so pacing never slows the upstream down. If the source raises, the queued tokens are
    delivered first, then the error."""
    iterator = aiter(source)
    pending: asyncio.Future | None = None
    try:
        while True:
            for item in pacer.due(clock()):
                yield item
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            release = pacer.next_release()
            if not await wait(pending, None if release is None else max(0.0, release - clock())):
                continue
            finished, pending = pending, None
            try:
                event = finished.result()
            except StopAsyncIteration:
                for item in pacer.flush():
                    yield item
                return
            except BaseException:
                for item in pacer.flush():
                    yield item
                raise
            if is_batch(event):
                pacer.push(event, clock())  # type: ignore[arg-type]
                continue
            for item in pacer.flush():
                yield item
            yield event  # type: ignore[misc]
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()
