"""What every tandem gRPC server and client shares: health, reflection, channel options."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Verdicts with hidden states and prompts of 100k tokens exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Reconnect to a restarted upstream within seconds, not gRPC's default of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


KEEPALIVE_MS = dict(CHANNEL_OPTIONS)["grpc.keepalive_time_ms"]
# A server counts a ping that comes sooner than this after the last one, with no data between, as
# a strike, and after two it ends the connection (GOAWAY "too_many_pings"). gRPC's default is five
# minutes, so an idle stack's channels, which ping every KEEPALIVE_MS, lost their connections after
# about 90 s and the next requests met a reconnect.
MIN_PING_INTERVAL_MS = KEEPALIVE_MS // 2
# What a server accepts in one message. Requests are token ids and a few numbers (a Prefill of a
# million-token prompt is ~5 MB); only answers carry hidden states. A bigger request is refused
# with RESOURCE_EXHAUSTED by gRPC before it is parsed, so no caller makes a server hold 256 MiB.
MAX_REQUEST_BYTES = 16 * 1024 * 1024
# A second server on a busy port must fail, not silently share it (SO_REUSEPORT is on by default).
SERVER_OPTIONS = [
    *(option for option in CHANNEL_OPTIONS if option[0] != "grpc.max_receive_message_length"),
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
]


def make_server(interceptors: Iterable[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=list(interceptors))


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


class Health:
    """The grpc.health.v1 servicer. Call ``await not_serving()`` before the server starts and
    ``await serving()`` once the model is loaded and warmed."""

    def __init__(self, server: grpc.aio.Server, service_names: Iterable[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self.names = ["", *service_names]
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def _set(self, status: int) -> None:
        for name in self.names:
            await self.servicer.set(name, status)

    async def serving(self) -> None:
        await self._set(health_pb2.HealthCheckResponse.SERVING)

    async def not_serving(self) -> None:
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Binds with TLS when given ``credentials`` (tandem.rpc.security), in plaintext otherwise;
    returns the real port (useful with port 0 in tests)."""
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as error:
        raise OSError(f"cannot bind gRPC server to {host}:{port}: {error}") from error
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    return bound
