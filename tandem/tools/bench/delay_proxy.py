"""A TCP proxy that delays every byte by a one-way latency: a network hop between two services on
one machine (issue 28's draft-target delay).

Each direction of each connection forwards what it reads ``delay_s`` after reading it, in order,
so a request-reply exchange through the proxy takes two delays more than without it, as over a
link of that one-way latency with bandwidth to spare. ``delay_s`` may change while connections are
open (a bench interleaves delays on one stack); bytes already on their way keep their delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

log = logging.getLogger(__name__)

CHUNK = 64 * 1024


class DelayProxy:
    """``await start()`` listens on ``host:port`` (0: a free port, see ``port``) and forwards each
    connection to ``upstream`` ("host:port")."""

    def __init__(self, upstream: str, delay_s: float = 0.0, host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream_host, _, upstream_port = upstream.rpartition(":")
        self.upstream_port = int(upstream_port)
        self.delay_s = delay_s
        self._host, self._port = host, port
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    async def start(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError as exc:
            log.warning("delay proxy: cannot reach %s:%d: %s", self.upstream_host, self.upstream_port, exc)
            client_writer.close()
            return
        for reader, writer in ((client_reader, upstream_writer), (upstream_reader, client_writer)):
            task = asyncio.create_task(self._pipe(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Reads as bytes come and writes each chunk once its delay has passed, in order."""
        loop = asyncio.get_running_loop()
        due: deque[tuple[float, bytes]] = deque()  # (when to write, the bytes)
        arrived = asyncio.Event()
        ended = False

        async def read() -> None:
            nonlocal ended
            try:
                while data := await reader.read(CHUNK):
                    due.append((loop.time() + self.delay_s, data))
                    arrived.set()
            except (ConnectionError, OSError):
                pass
            finally:
                ended = True
                arrived.set()

        reading = asyncio.create_task(read())
        try:
            while True:
                if not due:
                    if ended:
                        break
                    arrived.clear()
                    await arrived.wait()
                    continue
                when, data = due[0]
                wait = when - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                due.popleft()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()
            with contextlib.suppress(Exception):
                writer.close()
