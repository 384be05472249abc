"""One *leg* of a session: a single upstream stream (``Speculate`` or ``Generate``) read to its end.

A generation is a sequence of legs (see :mod:`gateway.adaptive` for why switching happens only
between them). This module holds what a leg needs and nothing about policy: the gateway-side
timing of messages with an optional stall deadline, and the classification of a draft's failure
into what the breaker and the fallback need to know. (The batch type a leg yields is
:class:`gateway.types.Batch`; :mod:`gateway.leg_reader` reads the legs.)
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from gateway.breaker import DraftFailure
from gateway.errors import GatewayError, InvalidRequest, UpstreamUnavailable
from gateway.pool import Member
from gateway.upstream import UpstreamStream

M = TypeVar("M")

# A draft that refuses the session itself (bad request, other tokenizer) is not an outage:
# decoding on without it would hide a configuration error, so such failures are not recovered.
_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


class DraftLegFailed(Exception):
    """A speculative leg ended in a draft failure; ``error`` is what the client would see and
    ``member`` the draft that failed (None: the pool had no draft to place the leg on)."""

    def __init__(self, failure: DraftFailure, error: GatewayError, recoverable: bool = True,
                 member: Member[Any] | None = None) -> None:
        super().__init__(error.message)
        self.failure = failure
        self.error = error
        self.recoverable = recoverable
        self.member = member


def classify_draft_error(error: GatewayError, member: Member[Any] | None = None) -> DraftLegFailed:
    if isinstance(error, UpstreamUnavailable):
        return DraftLegFailed(DraftFailure.UNREACHABLE, error, member=member)
    cause = error.__cause__
    code = cause.code() if isinstance(cause, grpc.aio.AioRpcError) else None
    refused = isinstance(error, InvalidRequest) or code in _REFUSALS
    return DraftLegFailed(DraftFailure.FAILED, error, recoverable=not refused, member=member)


async def timed(
    stream: UpstreamStream[M],
    clock: Callable[[], float],
    deadline_s: float | None = None,
    keep_waiting: Callable[[float], bool | Awaitable[bool]] = lambda waited_s: False,
) -> AsyncIterator[tuple[M, float | None]]:
    """Messages of ``stream`` with the seconds since the previous one (None for the first, whose
    wait includes the call's set-up). With ``deadline_s``, a wait longer than that raises
    :class:`TimeoutError` (the stream is left to the caller to cancel), unless
    ``keep_waiting(seconds waited so far)`` (a function or a coroutine function) says to give it
    another ``deadline_s``; what it raises comes out of the iteration."""
    iterator: Any = aiter(stream)
    last: float | None = None
    try:
        while True:
            try:
                message = await (anext(iterator) if deadline_s is None else _patient(iterator, deadline_s, keep_waiting))
            except StopAsyncIteration:
                return
            now = clock()
            yield message, None if last is None else now - last
            last = now
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()


async def _patient(iterator: Any, deadline_s: float, keep_waiting: Callable[[float], bool | Awaitable[bool]]) -> Any:
    """The next message; TimeoutError once a wait of ``deadline_s`` ends with ``keep_waiting`` False."""
    pending = asyncio.ensure_future(anext(iterator))
    waited = 0.0
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=deadline_s)
            if done:
                return pending.result()
            waited += deadline_s
            verdict = keep_waiting(waited)
            if not (await verdict if inspect.isawaitable(verdict) else verdict):
                raise TimeoutError
    finally:
        if not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
