"""Continuous batching: the verify blocks and decode steps that arrive while the target is busy
share its next forward pass.

Each Verify stream and Generate stream hands its next call to :meth:`PassBatcher.run` and waits.
The first call to arrive queues one "drain" on the model thread; when the drain's turn comes, it
takes every call pending by then (at most one per session, whose calls depend on each other, and
at most ``max_tokens`` rows in all) and runs them as one pass (``TargetEngine.run_batch``). So
with one session nothing changes (a pass of one, as before), and with many, each pass serves as
many of them as its row budget allows, while a prefill chunk queued meanwhile still gets its turn
between two drains. A call whose caller went away before its pass started is dropped unrun.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tandem.models.worker import ModelWorker


@dataclass
class _Pending:
    call: Any  # a DraftBlock or a DecodeStep: anything with a session_id
    rows: int  # tokens it feeds the pass
    future: Future


class PassBatcher:
    def __init__(
        self, worker: ModelWorker, run_batch: Callable[[Sequence[Any]], Sequence[Any]], max_tokens: int = 64
    ) -> None:
        """``run_batch(calls)`` answers each call with its result or its exception (in order)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self._worker = worker
        self._run_batch = run_batch
        self.max_tokens = max_tokens
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()  # calls arrive on the event loop, drains run on the model thread
        self._drain_queued = False

    @property
    def queued(self) -> int:
        """Calls waiting for a pass (not yet taken by a drain); a load figure, read without the lock."""
        return len(self._pending)

    async def run(self, call: Any, rows: int) -> Any:
        """Runs ``call`` (``rows`` tokens) in the next pass that has room for it; returns its answer."""
        pending = _Pending(call, max(1, rows), Future())
        with self._lock:
            self._pending.append(pending)
            queue_drain = not self._drain_queued
            self._drain_queued = True
        if queue_drain:
            self._worker.submit(self._drain)
        return await asyncio.wrap_future(pending.future)

    def _drain(self) -> None:
        """On the model thread: one pass over the calls pending now; queues the next drain if some
        had to wait (a second call of a session in this pass, or no room left)."""
        batch = self._take()
        live = [p for p in batch if p.future.set_running_or_notify_cancel()]  # skips callers gone
        if not live:
            return
        try:
            answers = self._run_batch([p.call for p in live])
        except Exception as error:  # noqa: BLE001 (a bug in the batch itself: every caller hears of it)
            answers = [error] * len(live)
        for pending, answer in zip(live, answers):
            if isinstance(answer, BaseException):
                pending.future.set_exception(answer)
            else:
                pending.future.set_result(answer)

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        left: deque[_Pending] = deque()
        seen: set[str] = set()  # sessions already in the pass, or waiting behind one of their calls
        rows = 0
        with self._lock:
            while self._pending:
                pending = self._pending.popleft()
                if pending.future.cancelled():
                    continue
                session_id = pending.call.session_id
                if session_id in seen or (batch and rows + pending.rows > self.max_tokens):
                    left.append(pending)
                else:
                    batch.append(pending)
                    rows += pending.rows
                seen.add(session_id)
            self._pending = left
            self._drain_queued = bool(left)
        if left:
            self._worker.submit(self._drain)
        return batch
