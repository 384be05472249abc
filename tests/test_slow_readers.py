"""Clients that stop reading a streamed response (tandem.rpc.streams, gateway.http_util): once the
stream's buffers are full and nothing was read for --stream-stall-timeout-s, the stream is
cancelled and its sessions are released, while other requests are served meanwhile."""

from __future__ import annotations

import asyncio
import json
import socket

import grpc
import httpx
from gateway_fakes import fake_stack

from tandem.rpc import streams
from tandem.v1 import gateway_pb2

STALL_S = 1.0
# Enough tokens that their SSE chunks overflow the gateway's and the kernel's buffers for a
# reader with a small receive window.
MANY = 20_000


def stuck_http_client(port: int, body: dict) -> socket.socket:
    """Sends the request and never reads (a tiny receive buffer, so the server's fill soon)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


async def wait_released(stack, timeout_s: float = 60.0) -> None:
    await stack.wait_until_idle(timeout=timeout_s)


async def test_an_http_stream_nobody_reads_is_cancelled_and_others_are_served(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), stream_stall_timeout_s=STALL_S, default_max_tokens=MANY,
                          max_context_len=2 * MANY) as stack:
        model = stack.gateway.core.model.name
        body = {"model": model, "prompt": "stuck", "max_tokens": MANY, "stream": True, "ignore_eos": True,
                "speculation": "off"}
        sock = stuck_http_client(stack.gateway.http_port, body)
        try:
            await asyncio.sleep(0.5)
            assert stack.gateway.core.admission.in_flight == 1
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:  # not held up
                reply = await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4})
                assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
            await wait_released(stack)  # the stuck stream's sessions went back
        finally:
            sock.close()


class StuckContext:
    """A servicer context whose writes never go out (a reader that stopped reading)."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def write(self, message) -> None:
        await asyncio.Event().wait()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


async def test_a_grpc_write_that_waits_past_the_stall_ends_the_call_with_resource_exhausted():
    """gRPC buffers megabytes per stream on both sides before a write waits (measured while
    building this: ~150k small messages), so the wait itself is tested here: every streaming
    handler writes through ``streams.write`` (target Verify and Generate, draft Speculate,
    gateway Generate)."""
    context = StuckContext()
    started = asyncio.get_running_loop().time()
    try:
        await streams.write(context, gateway_pb2.GatewayServiceGenerateResponse(text="x"), stall_s=0.2)
    except grpc.aio.AbortError:
        pass
    assert context.aborted is not None and context.aborted[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "read nothing for 0 s" in context.aborted[1] or "read nothing" in context.aborted[1]
    assert asyncio.get_running_loop().time() - started >= 0.2


async def test_a_grpc_write_that_goes_out_in_time_is_not_touched():
    class Prompt(StuckContext):
        async def write(self, message) -> None:
            self.written = message

    context = Prompt()
    await streams.write(context, "m", stall_s=5)
    assert context.written == "m" and context.aborted is None
