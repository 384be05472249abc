"""Writing to a stream whose reader may have stopped reading.

gRPC's flow control bounds what one stream buffers (HTTP/2 windows, a few MB at most), so a
reader that stops reading makes the server's next write wait, for as long as the reader likes,
while the server holds that stream's session: its KV cache, a draft slot, a concurrency slot.
:func:`write` waits at most ``stall_s`` for a write to go out and then ends the call with
RESOURCE_EXHAUSTED (a reader that reads again sees that status after the messages it had
buffered), so a stuck reader costs the service one stream's buffers for ``stall_s`` and no more.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

#: How long a write may wait for a reader that stopped reading before the stream is cancelled.
#: Generous: a slow network drains a stream's buffers in far less; only a stuck reader waits this long.
STALL_S = 30.0


async def write(context: grpc.aio.ServicerContext, message: Any, stall_s: float = STALL_S) -> None:
    """``context.write(message)``; aborts the call (RESOURCE_EXHAUSTED) when the reader has let it
    wait ``stall_s`` seconds."""
    pending = asyncio.ensure_future(context.write(message))
    pending.add_done_callback(lambda write: write.cancelled() or write.exception())  # retrieved, not logged
    done, _ = await asyncio.wait({pending}, timeout=stall_s)
    if not done:
        # Not cancelled: the call's end settles the pending write.
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the client read nothing for {stall_s:.0f} s and this stream's buffers are full: stream cancelled",
        )
    pending.result()  # a failed write raises as context.write would
