"""Admission control: at most ``limit`` requests in flight, the rest refused at once.

Refusing (429 / RESOURCE_EXHAUSTED) rather than queueing keeps latency bounded and tells a load
balancer or client to back off; both APIs share one counter because they share the upstreams.
"""

from __future__ import annotations

from gateway.errors import Overloaded


class AdmissionControl:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def admit(self) -> Ticket:
        """A ticket for one request; raises :class:`Overloaded` when the gateway is full."""
        if self.in_flight >= self.limit:
            raise Overloaded(
                f"the gateway is serving its maximum of {self.limit} concurrent requests; retry later",
                code="too_many_requests",
            )
        self.in_flight += 1
        return Ticket(self)


class Ticket:
    """One admitted request; :meth:`release` is idempotent so every exit path may call it."""

    def __init__(self, control: AdmissionControl) -> None:
        self._control: AdmissionControl | None = control

    def release(self) -> None:
        if self._control is not None:
            self._control.in_flight -= 1
            self._control = None
