"""The gateway's own HTTP listening socket: connections accepted from it send small writes at once."""

from __future__ import annotations

import asyncio
import socket

from gateway.main import _bind_http_socket


async def test_accepted_connections_have_nodelay() -> None:
    """Without TCP_NODELAY a streamed SSE chunk that follows another small write (the response
    headers) waits for the client's delayed ACK on a kept-alive connection: 40 ms of TTFT."""
    sock = _bind_http_socket("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=sock)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        assert await asyncio.wait_for(accepted, 5) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


def test_a_taken_port_is_a_clear_error() -> None:
    taken = _bind_http_socket("127.0.0.1", 0)
    try:
        taken.listen()
        try:
            _bind_http_socket("127.0.0.1", taken.getsockname()[1])
        except OSError as exc:
            assert "cannot bind the HTTP server to 127.0.0.1" in str(exc)
        else:
            raise AssertionError("binding a taken port succeeded")
    finally:
        taken.close()
