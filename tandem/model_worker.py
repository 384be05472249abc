"""A service's one model thread (the target's and the draft's).

Model forwards take milliseconds to seconds; running them on the event loop would stall every
other session's gRPC traffic. One dedicated thread (not a pool) also serialises forward passes and
means sessions are only ever touched by a single thread, in submission order, so they need no
locks, and a session freed after a cancelled call cannot race the work still running for it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ModelWorker:
    def __init__(self, name: str = "model") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Runs ``fn(*args)`` on the model thread and waits for it without blocking the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Queues ``fn(*args)`` behind the work already queued, without waiting (for cleanup
        that must not race an in-flight call)."""
        self._executor.submit(fn, *args)

    def shutdown(self, wait: bool = True) -> None:
        """Drops queued work; ``wait`` also waits for the call in progress (a model load may take
        a while, so a failed start-up does not wait for it)."""
        self._executor.shutdown(wait=wait, cancel_futures=True)
