"""The draft's gRPC client of the target: health wait, Info, Release, and per-session Verify streams."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service import wire
from draft_service.errors import ProtocolError, TargetUnavailableError
from draft_service.types import ProposedBlock, TargetInfo, Verdict
from tandem import telemetry
from tandem.rpc.endpoints import CHANNEL_OPTIONS
from tandem.rpc.security import PLAINTEXT, HopSecurity
from tandem.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

_TARGET_SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
_VERIFY = telemetry.full_method(_TARGET_SERVICE, "Verify")
_RELEASE = telemetry.full_method(_TARGET_SERVICE, "Release")
SERVING = health_pb2.HealthCheckResponse.ServingStatus.Name(health_pb2.HealthCheckResponse.SERVING)


class GrpcVerifyStream:
    """One session's bidirectional Verify call: a block out, its verdict back, one at a time."""

    def __init__(
        self, call: grpc.aio.StreamStreamCall, close_timeout_s: float = 5.0, span: telemetry.ClientCall | None = None
    ) -> None:
        self._call = call
        self._close_timeout_s = close_timeout_s
        self._span = span if span is not None else telemetry.ClientCall(None, None)

    async def verify(self, block: ProposedBlock) -> Verdict:
        """Sends ``block`` and waits for its verdict (nothing else in flight)."""
        await self.send(block)
        return await self.receive(block.block_id)

    async def send(self, block: ProposedBlock) -> None:
        """Sends ``block`` without waiting for any verdict: blocks sent one after another are
        verified in order, each against what the ones before it committed."""
        # Errors the target ends the stream with (NOT_FOUND session, ...) raise AioRpcError here or
        # in receive, with the target's code and message, which the server passes on to its caller.
        try:
            try:
                await self._call.write(wire.verify_request(block))
            except asyncio.InvalidStateError:
                # The call ended before this block went out (the target died between two blocks):
                # its own status says why, as the target's error.
                raise await self._ended() from None
        except grpc.aio.AioRpcError as exc:
            self._span.end(exc)
            raise

    async def receive(self, block_id: int) -> Verdict:
        """The next verdict, which is block ``block_id``'s (the oldest sent and not answered)."""
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            self._span.end(exc)
            raise
        if response is grpc.aio.EOF:
            raise ProtocolError(f"the target ended the Verify stream without a verdict for block {block_id}")
        return wire.verdict_from_response(response)

    async def _ended(self) -> grpc.aio.AioRpcError:
        """The finished call's status as the error a failed read would have raised."""
        call = self._call
        return grpc.aio.AioRpcError(await call.code(), await call.initial_metadata(), await call.trailing_metadata(),
                                    await call.details())

    async def close(self) -> None:
        try:
            await self._call.done_writing()
            await asyncio.wait_for(self._call.code(), self._close_timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError) as exc:
            log.debug("Verify stream did not end cleanly (%r); cancelling it", exc)
            self._call.cancel()
            self._span.end(exc if isinstance(exc, grpc.aio.AioRpcError) else None, cancelled=True)
        except BaseException:  # cancelled while closing: the span still ends
            self._span.end(cancelled=True)
            raise
        self._span.end()

    def cancel(self) -> None:
        self._call.cancel()
        self._span.end(cancelled=True)


class TargetClient:
    """One channel to one target (``address``): the draft keeps one per target of its pool.
    ``server_name``: the name its certificate is checked against (the pool entry's host)."""

    def __init__(self, address: str, server_name: str = "", security: HopSecurity = PLAINTEXT) -> None:
        self.address = address
        self._channel = security.aio_channel(address, CHANNEL_OPTIONS, server_name)
        self._auth = security.call_metadata
        self._dials_tls = security.dials_tls
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def health_state(self, timeout_s: float = 5.0) -> str:
        """The target's gRPC health now: "SERVING", another serving status, or the call's error code."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def wait_until_serving(
        self, timeout_s: float | None = None, poll_s: float = 0.25, log_every_s: float = 10.0
    ) -> None:
        """Polls the target's gRPC health until SERVING, so draft and target may start in any order.

        ``timeout_s`` None waits forever (the process is stopped by a signal instead).
        """
        started = time.monotonic()
        last_log = started
        while (state := await self.health_state()) != SERVING:
            now = time.monotonic()
            if timeout_s is not None and now - started >= timeout_s:
                raise TargetUnavailableError(f"target at {self.address} is not SERVING after {timeout_s:.0f}s ({state})")
            if now - last_log >= log_every_s:
                hint = "; if it serves TLS, give this draft --tls-ca (and --tls-cert/--tls-key for mutual TLS)" \
                    if state == "UNAVAILABLE" and not self._dials_tls else ""
                log.info("waiting for the target at %s to be SERVING (%s%s)", self.address, state, hint)
                last_log = now
            await asyncio.sleep(poll_s)

    async def info(self) -> TargetInfo:
        reply = await self._stub.Info(target_pb2.TargetServiceInfoRequest(), timeout=30.0, metadata=self._auth)
        return wire.target_info_from_response(reply)

    async def release(self, session_id: str) -> bool:
        with telemetry.client_call(_RELEASE, self.address, self._auth) as call:
            reply = await self._stub.Release(target_pb2.ReleaseRequest(session_id=session_id), metadata=call.metadata)
        return reply.released

    def open_verify_stream(self, session_id: str) -> GrpcVerifyStream:
        # The session id travels in every block; the metadata only labels the call (and carries
        # the trace context when tracing is on).
        span = telemetry.client_call(_VERIFY, self.address, (("tandem-session-id", session_id), *self._auth))
        return GrpcVerifyStream(self._stub.Verify(metadata=span.metadata), span=span)

    async def close(self) -> None:
        await self._channel.close()
