"""gRPC clients for the two upstreams: the target service and the draft service.

:class:`generation.Generation` depends only on the small protocols :class:`TargetUpstream` and
:class:`DraftUpstream`, so tests can drive it with in-memory fakes. The gRPC implementations turn
every ``grpc.aio.AioRpcError`` into a :class:`gateway.errors.GatewayError` that names the service
and its address, so a client reads e.g. "the draft service at 127.0.0.1:50052 is unavailable"
rather than a bare status code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Generic, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import (
    GatewayError,
    InvalidRequest,
    Overloaded,
    TargetLost,
    TargetNotServed,
    UpstreamFailure,
    UpstreamUnavailable,
)
from tandem import telemetry
from tandem.rpc.endpoints import CHANNEL_OPTIONS
from tandem.rpc.security import PLAINTEXT, HopSecurity
from tandem.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

_TARGET = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
_DRAFT = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name

RELEASE_TIMEOUT_S = 5.0
# gRPC backs off up to 2 minutes between reconnection attempts by default, so an upstream that
# restarts would stay "unavailable" to the gateway long after it is back. Upstreams are local
# services on a known address: retrying often is cheap.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class UpstreamStream(Protocol[T_co]):
    """A server stream that can be cancelled by the caller."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    def cancel(self) -> None: ...


class TargetUpstream(Protocol):
    async def is_serving(self, timeout: float) -> bool: ...

    async def prefill(self, request: target_pb2.PrefillRequest) -> target_pb2.PrefillResponse: ...

    def generate(
        self, request: target_pb2.TargetServiceGenerateRequest
    ) -> UpstreamStream[target_pb2.TargetServiceGenerateResponse]: ...

    async def release(self, session_id: str) -> bool: ...


class DraftUpstream(Protocol):
    def speculate(self, request: draft_pb2.SpeculateRequest) -> UpstreamStream[draft_pb2.SpeculateResponse]: ...


# Trailing metadata a draft adds when a Speculate call failed because of its target.
FAILED_HOP_KEY = "tandem-failed-hop"
TARGET_ADDRESS_KEY = "tandem-target-address"
# Its value when the draft refused the call because the target named is not one of its own.
UNKNOWN_TARGET = "unknown-target"
# The codes that say a session's target is gone (or forgot the session), not that it refused.
_LOST = {grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.NOT_FOUND: "session_lost",
         grpc.StatusCode.DEADLINE_EXCEEDED: "timeout"}


def translate(service: str, address: str, error: grpc.aio.AioRpcError) -> GatewayError:
    """The client-facing error for an upstream's gRPC status. A target that is gone, or a draft
    that says its target is, gives :class:`TargetLost` (the gateway moves the session)."""
    code, details = error.code(), error.details() or ""
    where = f"the {service} service at {address}"
    trailing = dict(error.trailing_metadata() or ())
    if service == "draft" and trailing.get(FAILED_HOP_KEY) == UNKNOWN_TARGET:
        target = str(trailing.get(TARGET_ADDRESS_KEY, "?"))
        return TargetNotServed(f"{where} does not serve the target {target}: {details}", draft=address, target=target)
    if service == "draft" and trailing.get(FAILED_HOP_KEY) == "target" and code in _LOST:
        target = str(trailing.get(TARGET_ADDRESS_KEY, "?"))
        return TargetLost(f"the target service at {target} failed under the draft at {address}: {details}",
                          reason=_LOST[code], address=target)
    if service == "target" and code in _LOST:
        return TargetLost(f"{where} is unavailable: {details}" if code != grpc.StatusCode.NOT_FOUND
                          else f"{where} lost the session: {details}", reason=_LOST[code], address=address)
    if code == grpc.StatusCode.UNAVAILABLE:
        return UpstreamUnavailable(f"{where} is unavailable: {details}", code="upstream_unavailable")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(f"{where} is at capacity: {details}", code="upstream_overloaded")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        # A grammar the target cannot compile is the request's response_format (HTTP's name for it); a
        # bias of a token outside the target's vocabulary, its logit_bias.
        param = "response_format" if details.startswith("grammar") else None
        param = "logit_bias" if details.startswith("logit_bias") else param
        return InvalidRequest(f"{where} refused the request: {details}", param=param)
    return UpstreamFailure(f"{where} failed ({code.name}): {details}", code="upstream_error")


class GrpcStream(Generic[T]):
    """A ``grpc.aio`` server-streaming call whose errors come out translated."""

    def __init__(
        self, call: grpc.aio.UnaryStreamCall, service: str, address: str, span: telemetry.ClientCall | None = None
    ) -> None:
        self._call = call
        self._service = service
        self._address = address
        self._span = span if span is not None else telemetry.ClientCall(None, None)

    async def __aiter__(self) -> AsyncIterator[T]:
        try:
            async for message in self._call:
                yield message
        except grpc.aio.AioRpcError as exc:
            self._span.end(exc, cancelled=self._call.cancelled())
            raise translate(self._service, self._address, exc) from exc
        except BaseException:  # the consumer left (GeneratorExit) or was cancelled
            self._span.end(cancelled=True)
            raise
        self._span.end()

    def cancel(self) -> None:
        self._call.cancel()
        self._span.end(cancelled=True)


class _GrpcUpstream:
    """A channel to one upstream plus the standard health check every tandem service serves.
    ``server_name``: the name its certificate is checked against (the pool entry's host)."""

    service = ""

    def __init__(self, address: str, server_name: str = "", security: HopSecurity = PLAINTEXT) -> None:
        self.address = address
        self._channel = security.aio_channel(address, [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS], server_name)
        self._auth = security.call_metadata
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def is_serving(self, timeout: float) -> bool:
        try:
            answer = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    async def _unary(self, method, request, timeout: float | None = None, traced_as: str = ""):
        """Calls ``method``; ``traced_as`` (the full method name) gives the call a CLIENT span."""
        call = (telemetry.client_call(traced_as, self.address, self._auth) if traced_as
                else telemetry.ClientCall(None, self._auth or None))
        with call:
            try:
                return await method(request, timeout=timeout, metadata=call.metadata)
            except grpc.aio.AioRpcError as exc:
                call.end(exc)
                raise translate(self.service, self.address, exc) from exc

    def _stream(self, method, request, traced_as: str) -> GrpcStream:
        call = telemetry.client_call(traced_as, self.address, self._auth)
        return GrpcStream(method(request, metadata=call.metadata), self.service, self.address, call)

    async def close(self) -> None:
        await self._channel.close()


class GrpcTarget(_GrpcUpstream):
    service = "target"

    def __init__(self, address: str, server_name: str = "", security: HopSecurity = PLAINTEXT) -> None:
        super().__init__(address, server_name, security)
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)

    async def info(self, timeout: float) -> target_pb2.TargetServiceInfoResponse:
        return await self._unary(self._stub.Info, target_pb2.TargetServiceInfoRequest(), timeout)

    async def prefill(self, request: target_pb2.PrefillRequest) -> target_pb2.PrefillResponse:
        return await self._unary(self._stub.Prefill, request, traced_as=f"/{_TARGET}/Prefill")

    def generate(
        self, request: target_pb2.TargetServiceGenerateRequest
    ) -> GrpcStream[target_pb2.TargetServiceGenerateResponse]:
        return self._stream(self._stub.Generate, request, f"/{_TARGET}/Generate")

    async def release(self, session_id: str) -> bool:
        request = target_pb2.ReleaseRequest(session_id=session_id)
        return (await self._unary(self._stub.Release, request, RELEASE_TIMEOUT_S, f"/{_TARGET}/Release")).released


class GrpcDraft(_GrpcUpstream):
    service = "draft"

    def __init__(self, address: str, server_name: str = "", security: HopSecurity = PLAINTEXT) -> None:
        super().__init__(address, server_name, security)
        self._stub = draft_pb2_grpc.DraftServiceStub(self._channel)

    async def info(self, timeout: float) -> draft_pb2.DraftServiceInfoResponse:
        return await self._unary(self._stub.Info, draft_pb2.DraftServiceInfoRequest(), timeout)

    def speculate(self, request: draft_pb2.SpeculateRequest) -> GrpcStream[draft_pb2.SpeculateResponse]:
        return self._stream(self._stub.Speculate, request, f"/{_DRAFT}/Speculate")
