"""HTTP plumbing the OpenAI app needs beyond FastAPI's defaults.

* :class:`ClosingStreamingResponse`: Starlette abandons a streaming body when the client goes away
  (or never starts it), so cleanup put inside the body generator may never run. This response
  always closes the body and runs ``on_close`` (cancel upstream, release the target session).
* :func:`cancel_on_disconnect`: a non-streaming request is not cancelled by Starlette when its
  client disconnects; this watches for the disconnect so the generation stops at once.
* :func:`invalid_body`: pydantic's validation errors rephrased as one OpenAI-style message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import InvalidRequest

T = TypeVar("T")
log = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


class ClientStalled(Exception):
    """The client read nothing while a streamed response's buffers stayed full."""


class ClosingStreamingResponse(StreamingResponse):
    """An SSE response whose body generator is always closed and ``on_close`` always awaited.

    A client that stops reading makes a write wait once the connection's buffers are full; after
    ``stall_s`` the response is abandoned (the connection closes, ``on_close`` releases the
    sessions), so a stuck client holds a request slot for that long, not forever."""

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], Awaitable[None]],
                 stall_s: float = 30.0) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._content = content
        self._on_close = on_close
        self._stall_s = stall_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_or_give_up(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self._stall_s)
            except asyncio.TimeoutError:
                raise ClientStalled() from None

        try:
            await super().__call__(scope, receive, send_or_give_up)
        except Exception as exc:  # only a stall is handled here
            # In Starlette's task group (older ASGI servers) the stall may come in an exception group.
            if not all(isinstance(e, ClientStalled) for e in getattr(exc, "exceptions", [exc])):
                raise
            log.warning("a streaming client read nothing for %.0f s: its stream is cancelled", self._stall_s)
        finally:
            try:
                await self._content.aclose()
            finally:
                await self._on_close()


async def cancel_on_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Awaits ``work``, cancelling it and raising :class:`ClientDisconnected` if the client
    disconnects first. Call it only after the request body has been read."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientDisconnected()


def invalid_body(errors: Sequence[dict[str, Any]]) -> InvalidRequest:
    """One readable message for pydantic errors (the first offending field)."""
    if not errors:
        return InvalidRequest("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return InvalidRequest(f"the request body is not valid JSON: {detail}".rstrip(": "))
    field = _top_field(first)
    if field is None:
        return InvalidRequest("the request body must be a JSON object (Content-Type: application/json)")
    path = _path(first["loc"])
    if first.get("type") == "missing":
        return InvalidRequest(f"missing required field: {path}", param=field)
    same_field = [e for e in errors if _top_field(e) == field]
    if len(same_field) > 1:
        # A union field: pydantic reports one error per alternative type.
        reasons = "; ".join(dict.fromkeys(e["msg"] for e in same_field))
        return InvalidRequest(f"invalid value for {field}: no accepted form matches ({reasons})", param=field)
    return InvalidRequest(f"invalid value for {path}: {first['msg']}", param=field)


def _top_field(error: dict[str, Any]) -> str | None:
    parts = [part for part in error.get("loc", ()) if part != "body"]
    return str(parts[0]) if parts else None


def _path(loc: Sequence[str | int]) -> str:
    """``("body", "messages", 0, "role")`` → ``messages[0].role``."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path
