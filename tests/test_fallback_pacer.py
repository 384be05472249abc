"""gateway.pacer with a fake clock: cadence, bounded delay, order, flush, and the async driver."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from gateway.pacer import Pacer, PacerConfig, paced


def drain_at(pacer: Pacer, times: list[float]) -> list[tuple[float, object]]:
    """Releases collected by polling ``due`` at each of ``times``."""
    out = []
    for now in times:
        out += [(now, item) for item in pacer.due(now)]
    return out


def drain_until(pacer: Pacer, until: float) -> list[tuple[float, object]]:
    """Releases collected by polling ``due`` exactly at each release time up to ``until``."""
    out = []
    while (due := pacer.next_release()) is not None and due <= until:
        out += [(due, item) for item in pacer.due(due)]
    return out


def test_first_batch_leaves_at_once_then_rounds_are_spread_evenly():
    pacer = Pacer(PacerConfig(max_delay_s=10.0, window=1))
    pacer.push(["a"], now=0.0)  # the prefill token: no estimate yet
    assert pacer.due(0.0) == ["a"]
    pacer.push([1, 2, 3, 4], now=1.0)  # one round of 4 tokens after 1 s: 0.25 s per token
    assert pacer.next_release() == 1.0
    assert [t for t, _ in drain_at(pacer, [1.0, 1.25, 1.5, 1.75])] == [1.0, 1.25, 1.5, 1.75]
    pacer.push([5, 6, 7, 8], now=2.0)
    releases = drain_at(pacer, [2.0, 2.25, 2.5, 2.75])
    assert releases == [(2.0, 5), (2.25, 6), (2.5, 7), (2.75, 8)]


def test_no_token_waits_longer_than_one_round_and_order_is_kept():
    rng = random.Random(0)
    config = PacerConfig(max_delay_rounds=1.0, max_delay_s=10.0, window=8)
    pacer = Pacer(config)
    now, pushed, released = 0.0, [], []
    for _ in range(300):
        gap = rng.uniform(0.02, 0.2)
        # Poll finely up to the next arrival, as the driver would.
        steps = [now + gap * i / 10 for i in range(1, 11)]
        released += drain_at(pacer, steps[:-1])
        now = steps[-1]
        batch = list(range(len(pushed), len(pushed) + rng.randint(1, 6)))
        pacer.push(batch, now)
        bound = pacer.max_delay_s
        assert bound <= 0.2  # one round time: an average of gaps that are all <= 0.2 s
        pushed += batch
        # Every queued token, new or old, leaves within the current bound of this arrival.
        assert pacer.next_release() is None or pacer.next_release() <= now + bound + 1e-12
    released += [(now + 1.0, item) for item in pacer.flush()]
    assert [item for _, item in released] == pushed  # in order, none lost, none repeated
    times = [t for t, _ in released]
    assert times == sorted(times)


def test_a_queued_token_is_pulled_forward_when_the_bound_shrinks():
    pacer = Pacer(PacerConfig(max_delay_rounds=1.0, max_delay_s=10.0, window=1))
    pacer.push([0], now=0.0)
    pacer.due(0.0)
    pacer.push([1, 2, 3, 4, 5, 6, 7, 8], now=2.0)  # round 2 s, 0.25 s per token: last at 3.75
    assert pacer.max_delay_s == 2.0
    pacer.push([9], now=2.1)  # a quick round: bound 0.1 s, everything must leave by 2.2
    assert pacer.max_delay_s == pytest.approx(0.1)
    releases = drain_at(pacer, [2.0, 2.1, 2.2])
    assert [item for _, item in releases] == list(range(1, 10))
    assert max(t for t, _ in releases) <= 2.2 + 1e-12


def test_the_absolute_cap_bounds_the_delay_too():
    pacer = Pacer(PacerConfig(max_delay_rounds=1.0, max_delay_s=0.3, window=1))
    pacer.push([0], now=0.0)
    pacer.push(list(range(1, 11)), now=5.0)  # 10 tokens over a 5 s round would take 4.5 s
    assert pacer.max_delay_s == 0.3
    assert drain_at(pacer, [5.3])[-1] == (5.3, 10)
    assert len(pacer) == 0


def test_flush_releases_everything_left_in_order():
    pacer = Pacer(PacerConfig(max_delay_s=10.0, window=1))
    pacer.push([0], now=0.0)
    pacer.push([1, 2, 3, 4], now=1.0)
    assert pacer.due(1.0) == [0, 1]
    assert pacer.flush() == [2, 3, 4]
    assert pacer.next_release() is None and pacer.flush() == []


class FakeTime:
    """A clock and a waiter for :func:`paced`: waiting lets the source run (it is in-memory and
    never sleeps), and a wait that would block advances the clock to the deadline instead."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def wait(self, task: asyncio.Future, timeout: float | None) -> bool:
        for _ in range(5):
            if task.done():
                return True
            await asyncio.sleep(0)
        if timeout is None:
            await task
            return True
        self.now += timeout
        return False


async def test_paced_spreads_batches_flushes_at_the_end_and_passes_the_final_event():
    time = FakeTime()
    arrivals = [(0.0, ["t0"]), (1.0, ["t1", "t2", "t3", "t4"]), (2.0, ["t5", "t6"])]

    async def source():
        for at, batch in arrivals:
            time.now = max(time.now, at)
            yield batch
        yield "FINISHED"

    pacer = Pacer(PacerConfig(max_delay_s=10.0, window=1))
    seen = []
    async for event in paced(source(), pacer, is_batch=lambda e: isinstance(e, list), clock=time.clock,
                             wait=time.wait):
        seen.append((time.now, event))
    assert [e for _, e in seen] == ["t0", "t1", "t2", "t3", "t4", "t5", "t6", "FINISHED"]
    # The source is read ahead: t5/t6 and the finish arrive while t1..t4 are still paced, and the
    # finish flushes the queue at once.
    assert [t for t, _ in seen][:2] == [0.0, 1.0]
    assert seen[-1][1] == "FINISHED" and seen[-1][0] == seen[-2][0]


async def test_paced_delivers_queued_tokens_before_a_source_error():
    time = FakeTime()

    async def source():
        yield ["a"]
        time.now = 1.0
        yield ["b", "c", "d"]
        raise RuntimeError("upstream broke")

    seen = []
    with pytest.raises(RuntimeError, match="upstream broke"):
        async for event in paced(source(), Pacer(PacerConfig(window=1)),
                                 is_batch=lambda e: isinstance(e, list), clock=time.clock, wait=time.wait):
            seen.append(event)
    assert seen == ["a", "b", "c", "d"]


async def test_closing_paced_early_closes_the_source():
    closed = asyncio.Event()

    async def source():
        try:
            yield ["a"]
            await asyncio.Event().wait()  # never sends more
            yield ["b"]
        finally:
            closed.set()

    stream = paced(source(), Pacer(), is_batch=lambda e: isinstance(e, list), clock=lambda: 0.0)
    assert await anext(stream) == "a"
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await stream.aclose()
    assert closed.is_set()


def test_one_slow_round_does_not_stretch_the_cadence():
    pacer = Pacer(PacerConfig(max_delay_s=10.0, window=8))
    now = 0.0
    for _ in range(6):  # rounds of 4 tokens every 0.1 s: 0.025 s per token
        pacer.push([0, 1, 2, 3], now)
        drain_until(pacer, now + 0.099)
        now += 0.1
    now += 1.0  # a stall: one 1.1 s gap
    pacer.push([0, 1, 2, 3], now)
    drain_until(pacer, now + 0.099)
    now += 0.1
    pacer.push(["a", "b", "c", "d"], now)
    releases = [t for t, _ in drain_until(pacer, now + 1.0)]
    assert len(releases) == 4
    assert now <= releases[0] < now + 0.01
    # The stall counts as a round of at most 1.5 typical gaps, not 1.1 s: the cadence stays near
    # 0.025 s (unclipped, the 16-round rate would be 0.057 s, and one round's own rate 0.275 s).
    spacing = (releases[-1] - releases[0]) / 3
    assert 0.025 <= spacing < 0.03


def test_short_and_long_rounds_average_out_into_one_cadence():
    """Rounds of 3 and 1 tokens alternating every 0.1 s bring 2 tokens a round; within a bound of
    one round every token can leave 0.05 s after the previous one, with no pause after the short
    round and no bunching after the long one."""
    pacer = Pacer(PacerConfig(max_delay_rounds=1.0, max_delay_s=10.0, window=8))
    released = []
    for index in range(40):
        now = 0.1 * index
        pacer.push(list(range(3 if index % 2 == 0 else 1)), now)
        released += drain_until(pacer, now + 0.0999)
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(released)]
    assert all(g == pytest.approx(0.05, abs=1e-3) for g in gaps[len(gaps) // 2:])
    assert all(g < 0.1 - 1e-3 for g in gaps[4:])  # never a whole round without a token


def test_a_batch_larger_than_usual_is_spread_over_the_bound_not_bunched_at_it():
    pacer = Pacer(PacerConfig(max_delay_rounds=1.0, max_delay_s=10.0, window=8))
    for now in (0.0, 1.0, 2.0, 3.0):  # rounds of 2 tokens a second: 0.5 s per token
        pacer.push(["x", "y"], now)
        pacer.flush()
    pacer.push(list(range(8)), 4.0)  # 8 tokens at 0.5 s would need 3.5 s; the bound is 1 s
    releases = drain_at(pacer, [4.0 + i / 7 for i in range(8)])
    assert [item for _, item in releases] == list(range(8))
    assert [t for t, _ in releases] == [pytest.approx(4.0 + i / 7) for i in range(8)]
