"""Keepalive: an idle channel between two services keeps its connection.

Clients ping every ``KEEPALIVE_MS`` even without calls (``keepalive_permit_without_calls``). gRPC's
guide to keepalive: a server whose ``GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS`` (five
minutes unless set) exceeds its clients' keepalive time counts their pings as strikes and ends the
connection with GOAWAY "too_many_pings", failing the calls on it (seen between a gateway and its
target after a quiet minute and a half). tandem's servers permit what tandem's clients send."""

from __future__ import annotations

from tandem.rpc import endpoints as grpc_util


def test_servers_permit_the_pings_clients_send() -> None:
    server = dict(grpc_util.SERVER_OPTIONS)
    client = dict(grpc_util.CHANNEL_OPTIONS)
    assert client["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < client["grpc.keepalive_time_ms"]
