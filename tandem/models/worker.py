"""A service's one model thread (the target's and the draft's).

Model forwards take milliseconds to seconds; running them on the event loop would stall every
other session's gRPC traffic. One dedicated thread (not a pool) also serialises forward passes and
means sessions are only ever touched by a single thread, in submission order, so they need no
locks, and a session freed after a cancelled call cannot race the work still running for it.

Bookkeeping that must not wait behind the queue (freeing a session: under load the queue holds a
pass for every session, seconds of work, and a release that waits that long times out and leaves
the session's KV cache held until its TTL) goes through :meth:`ModelWorker.run_soon`: it runs on
the same thread, so it still never overlaps a pass, but between the pass in progress and the next.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ModelWorker:
    def __init__(self, name: str = "model") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # (call, its future): run before the next queued call starts.
        self._urgent: deque[tuple[Callable[[], Any], Future]] = deque()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Runs ``fn(*args)`` on the model thread and waits for it without blocking the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._after_urgent, functools.partial(fn, *args))

    async def run_soon(self, fn: Callable[..., T], *args: object) -> T:
        """Runs ``fn(*args)`` on the model thread ahead of the queued calls (right after the call in
        progress, if any) and waits for it. For quick bookkeeping only: it delays every queued call."""
        future: Future = Future()
        self._urgent.append((functools.partial(fn, *args), future))
        self._executor.submit(self._drain_urgent)  # in case nothing else is queued
        return await asyncio.wrap_future(future)

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Queues ``fn(*args)`` behind the work already queued, without waiting (for cleanup
        that must not race an in-flight call)."""
        self._executor.submit(self._after_urgent, functools.partial(fn, *args))

    def shutdown(self, wait: bool = True) -> None:
        """Drops queued work; ``wait`` also waits for the call in progress (a model load may take
        a while, so a failed start-up does not wait for it)."""
        self._executor.shutdown(wait=wait, cancel_futures=True)

    def _after_urgent(self, call: Callable[[], T]) -> T:
        self._drain_urgent()
        return call()

    def _drain_urgent(self) -> None:
        """Runs the urgent calls waiting, on the model thread; each result goes to its future."""
        while self._urgent:
            call, future = self._urgent.popleft()
            # A caller that gave up (a Release past its deadline) still has its call run.
            waited_for = future.set_running_or_notify_cancel()
            try:
                result = call()
            except Exception as error:  # noqa: BLE001 (handed to the caller, like run()'s errors)
                if waited_for:
                    future.set_exception(error)
                continue
            if waited_for:
                future.set_result(result)
