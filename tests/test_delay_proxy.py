"""The delaying TCP proxy the hop-delay bench puts between draft and target: bytes arrive whole
and in order, each direction no sooner than the delay (a lower bound only: a busy host may add),
and the delay can change while a connection is open."""

from __future__ import annotations

import asyncio
import time

from tandem.tools.bench.delay_proxy import DelayProxy


async def echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def test_bytes_come_back_whole_in_order_and_no_sooner_than_two_delays():
    server = await echo_server()
    upstream = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    proxy = await DelayProxy(upstream, delay_s=0.05).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        payload = bytes(range(256)) * 4096  # 1 MiB in many chunks
        started = time.monotonic()
        writer.write(payload)
        await writer.drain()
        received = await reader.readexactly(len(payload))
        assert received == payload
        assert time.monotonic() - started >= 0.1  # there and back
        proxy.delay_s = 0.0  # changed on an open connection
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        writer.close()
    finally:
        await proxy.stop()
        server.close()


async def test_an_unreachable_upstream_closes_the_client_connection():
    proxy = await DelayProxy("127.0.0.1:1").start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await proxy.stop()
