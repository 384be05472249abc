"""Admission control: at most ``limit`` requests in flight, the rest refused at once; and per API key
(:mod:`gateway.auth`) at most ``per_key`` in flight and ``rate_per_minute`` requests a minute.

Refusing (429 / RESOURCE_EXHAUSTED) rather than queueing keeps latency bounded and tells a load
balancer or client to back off; both APIs share one counter because they share the upstreams. A
per-key refusal says when to retry (``Overloaded.retry_after_s``: ``Retry-After`` over HTTP,
``grpc-retry-pushback-ms`` over gRPC), so that one noisy key cannot starve the others.

A key's rate is a token bucket: ``rate_per_minute`` requests in a burst, refilled evenly over the
minute. The clock is injected, so tests drive it without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import Overloaded

# When a key is at its concurrency limit, no finish time is known: ask the client to wait this long.
CONCURRENCY_RETRY_S = 1.0


@dataclass
class _Bucket:
    tokens: float
    at: float


class AdmissionControl:
    def __init__(self, limit: int, per_key: int = 0, rate_per_minute: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``per_key`` and ``rate_per_minute``: 0 = no limit of that kind."""
        self.limit = limit
        self.per_key = per_key
        self.rate_per_minute = rate_per_minute
        self.in_flight = 0
        self.by_key: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._clock = clock

    def admit(self, key: str | None = None) -> Ticket:
        """A ticket for one request of the API key ``key`` (its id; None: no keys); raises
        :class:`Overloaded` when the gateway, or the key's share of it, is full."""
        if self.in_flight >= self.limit:
            raise Overloaded(
                f"the gateway is serving its maximum of {self.limit} concurrent requests; retry later",
                code="too_many_requests",
            )
        if key is not None:
            self._admit_key(key)
        self.in_flight += 1
        if key is not None:
            self.by_key[key] = self.by_key.get(key, 0) + 1
        return Ticket(self, key)

    def _admit_key(self, key: str) -> None:
        if self.per_key and self.by_key.get(key, 0) >= self.per_key:
            raise Overloaded(f"API key {key} (key id) has its maximum of {self.per_key} requests in flight; "
                             "retry when one ends", code="too_many_requests", retry_after_s=CONCURRENCY_RETRY_S)
        if self.rate_per_minute:
            now = self._clock()
            bucket = self._buckets.setdefault(key, _Bucket(self.rate_per_minute, now))
            per_s = self.rate_per_minute / 60.0
            bucket.tokens = min(self.rate_per_minute, bucket.tokens + (now - bucket.at) * per_s)
            bucket.at = now
            if bucket.tokens < 1.0:
                raise Overloaded(f"API key {key} (key id) is over its rate of {self.rate_per_minute:g} requests a "
                                 "minute", code="rate_limit_exceeded", retry_after_s=(1.0 - bucket.tokens) / per_s)
            bucket.tokens -= 1.0

    def _release(self, key: str | None) -> None:
        self.in_flight -= 1
        if key is not None:
            left = self.by_key[key] - 1
            if left:
                self.by_key[key] = left
            else:
                del self.by_key[key]


class Ticket:
    """One admitted request; :meth:`release` is idempotent so every exit path may call it."""

    def __init__(self, control: AdmissionControl, key: str | None = None) -> None:
        self._control: AdmissionControl | None = control
        self._key = key

    def release(self) -> None:
        if self._control is not None:
            self._control._release(self._key)
            self._control = None
