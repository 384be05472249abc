"""tandem.models.worker: one thread, calls in order, urgent calls between two queued ones."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem.models.worker import ModelWorker


@pytest.fixture
def worker():
    worker = ModelWorker("test")
    yield worker
    worker.shutdown()


async def test_calls_run_on_one_thread_in_order(worker) -> None:
    seen: list[tuple[int, str]] = []

    def call(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * i

    results = await asyncio.gather(*(worker.run(call, i) for i in range(5)))
    assert results == [0, 1, 4, 9, 16]
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert len({name for _, name in seen}) == 1 and seen[0][1] != threading.current_thread().name


async def test_an_urgent_call_runs_after_the_call_in_progress_and_before_the_queue(worker) -> None:
    gate = threading.Event()
    order: list[str] = []

    def blocking() -> None:
        order.append("in progress")
        gate.wait(5)

    def queued(i: int) -> None:
        order.append(f"queued {i}")

    first = asyncio.ensure_future(worker.run(blocking))
    rest = [asyncio.ensure_future(worker.run(queued, i)) for i in range(3)]
    await asyncio.sleep(0.05)  # the first call is running, the others wait in the queue
    urgent = asyncio.ensure_future(worker.run_soon(order.append, "urgent"))
    await asyncio.sleep(0.05)
    assert not urgent.done()  # never overlaps the call in progress
    gate.set()
    await asyncio.gather(first, urgent, *rest)
    assert order == ["in progress", "urgent", "queued 0", "queued 1", "queued 2"]


async def test_an_urgent_call_on_an_idle_worker_runs_at_once_and_passes_errors_back(worker) -> None:
    assert await asyncio.wait_for(worker.run_soon(lambda: "done"), 2) == "done"

    def fails() -> None:
        raise KeyError("no such session")

    with pytest.raises(KeyError):
        await worker.run_soon(fails)
    assert await worker.run(lambda: "still serving") == "still serving"


async def test_an_urgent_call_whose_caller_gave_up_still_runs_and_the_worker_goes_on(worker) -> None:
    gate = threading.Event()
    ran: list[str] = []
    first = asyncio.ensure_future(worker.run(gate.wait, 5))
    await asyncio.sleep(0.02)
    urgent = asyncio.ensure_future(worker.run_soon(ran.append, "released"))
    await asyncio.sleep(0.02)
    urgent.cancel()
    gate.set()
    await first
    assert await worker.run(lambda: 42) == 42
    assert ran == ["released"]
