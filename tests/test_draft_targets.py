"""A draft in front of a pool of targets (``draft_service.targets``): each Speculate goes to the
target it names, a target outside the pool is refused, start-up takes any serving target, and a
call failed by its target says so in its trailing metadata.

Over real gRPC on loopback against fake targets (``draft_fakes``), on free ports.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from draft_fakes import FakeTargetService, load_tiny, start_fake_target

from draft_service.errors import TargetUnavailableError, UnknownTargetError
from draft_service.main import start_draft
from draft_service.proposers.ngram import NgramProposer
from draft_service.server import FAILED_HOP_KEY, TARGET_ADDRESS_KEY
from draft_service.targets import TargetRouter
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

PROMPT = (2, 40, 41, 42, 43, 44, 45, 46)


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_tiny(tiny_dir)


@pytest.fixture
async def pool(target):
    """Two fake targets and a draft started with both (A first)."""
    fakes = [await start_fake_target(target), await start_fake_target(target)]
    running = await start_draft(
        lambda info: NgramProposer(), ",".join(f.address for f in fakes), target_wait_s=10
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield fakes, running, draft_pb2_grpc.DraftServiceStub(channel)
    await channel.close()
    await running.stop(0)
    for fake in fakes:
        await fake.server.stop(None)


def prefill(fake, session_id: str, target_address: str = "", max_new_tokens: int = 0) -> draft_pb2.SpeculateRequest:
    """What the gateway does: Prefill in one target, then ask the draft, naming that target."""
    first, _ = fake.service.target.prefill(session_id, PROMPT, max_new_tokens=max_new_tokens)
    return draft_pb2.SpeculateRequest(
        session_id=session_id,
        token_ids=[*PROMPT, first],
        prompt_len=len(PROMPT),
        params=common_pb2.SessionParams(max_new_tokens=max_new_tokens),
        tokenizer_fingerprint=fake.service.fingerprint,
        target_address=target_address,
    )


async def tokens(stub, request) -> list[int]:
    return [t async for response in stub.Speculate(request) for t in response.token_ids]


def free_port() -> int:
    """A port nothing listens on (bound and let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def eventually(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------------- the router alone


class Lookup:
    """A DNS stand-in: host -> addresses, counting the look-ups."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        return list(self.table.get(host, []))


class Client:
    def __init__(self, address: str, server_name: str = "") -> None:
        self.address = address
        self.closed = False

    async def close(self) -> None:
        self.closed = True


async def test_the_router_allows_the_pool_only_and_resolves_again_once_for_a_stranger() -> None:
    lookup = Lookup({"targets": ["10.0.0.1"]})
    now = [0.0]
    router = TargetRouter("targets:7000, 127.0.0.1:7001", lookup=lookup, connect=Client, clock=lambda: now[0])
    assert router.default == "targets:7000" and router.address_of("") == "targets:7000"
    await router.resolve()
    assert router.members == ["10.0.0.1:7000", "127.0.0.1:7001"]
    assert router.allowed == ["targets:7000", "127.0.0.1:7001", "10.0.0.1:7000"]
    first = await router.client("10.0.0.1:7000")
    assert await router.client("10.0.0.1:7000") is first  # one channel per target
    assert (await router.client("")).address == "targets:7000"
    assert lookup.calls == 1  # members need no look-up
    # A pod that joined since the last resolution is found by resolving again ...
    lookup.table["targets"].append("10.0.0.2")
    assert (await router.client("10.0.0.2:7000")).address == "10.0.0.2:7000"
    assert lookup.calls == 2
    # ... but not again within a second: strangers do not make the draft ask DNS at their rate ...
    with pytest.raises(UnknownTargetError):
        await router.client("evil.example:443")
    assert lookup.calls == 2
    now[0] += 1.5
    # ... and an address outside the pool is refused after one more resolution, naming the pool.
    with pytest.raises(UnknownTargetError, match="10.0.0.1:7000") as refused:
        await router.client("evil.example:443")
    assert "evil.example:443" in str(refused.value) and lookup.calls == 3
    await router.close()
    assert first.closed


# --------------------------------------------------------------------------- over gRPC


async def test_each_session_is_served_by_the_target_it_names(pool) -> None:
    (a, b), _, stub = pool
    on_b = prefill(b, "on-b", b.address, max_new_tokens=6)
    assert len(await tokens(stub, on_b)) == 5
    assert b.service.requests and not a.service.requests
    assert {r.session_id for r in b.service.requests} == {"on-b"}
    # No target named: the first one configured.
    on_a = prefill(a, "on-a", "", max_new_tokens=6)
    assert len(await tokens(stub, on_a)) == 5
    assert {r.session_id for r in a.service.requests} == {"on-a"}
    # A session the named target does not hold is that target's NOT_FOUND (B never saw "on-a").
    wrong = prefill(a, "only-a", b.address, max_new_tokens=6)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await tokens(stub, wrong)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_target_outside_the_pool_is_invalid_argument(pool) -> None:
    (a, b), _, stub = pool
    good = prefill(a, "s", max_new_tokens=4)
    for bad, why in ((f"127.0.0.1:{free_port()}", "not one of"), ("no-port", "host:port"), ("a:1,b:2", "one target")):
        request = draft_pb2.SpeculateRequest()
        request.CopyFrom(good)
        request.target_address = bad
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await tokens(stub, request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert why in err.value.details(), bad
        trailing = dict(err.value.trailing_metadata() or ())
        if why == "not one of":  # said so (not a dead target): a gateway places the leg on another draft
            assert a.address in err.value.details() and b.address in err.value.details()
            assert trailing[FAILED_HOP_KEY] == "unknown-target", bad
        else:
            assert FAILED_HOP_KEY not in trailing, bad
    assert not a.service.requests and not b.service.requests  # nothing reached a target
    assert len(await tokens(stub, good)) == 3  # and the draft goes on serving


async def test_an_abandoned_session_is_released_in_its_own_target_and_info_counts_calls(pool) -> None:
    (a, b), running, stub = pool
    b.service.verify_delay_s = 0.05
    call = stub.Speculate(prefill(b, "s", b.address))  # no budget: runs until cancelled
    assert (await call.read()).token_ids
    info = await stub.Info(draft_pb2.DraftServiceInfoRequest())
    assert info.active_sessions == 1
    call.cancel()
    await eventually(lambda: b.service.released == ["s"])
    assert a.service.released == []
    await eventually(lambda: running.engine.active_sessions == [])
    assert (await stub.Info(draft_pb2.DraftServiceInfoRequest())).active_sessions == 0


class FailingTarget(FakeTargetService):
    """A target whose Verify stream fails the way a target going away does."""

    async def Verify(self, request_iterator, context):
        async for _ in request_iterator:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "target shutting down")
        yield  # an async generator, like the real handler


async def test_a_call_failed_by_its_target_names_the_hop_and_the_target(target) -> None:
    a = await start_fake_target(target)
    failing = await start_fake_target(target, service_class=FailingTarget)
    running = await start_draft(lambda info: NgramProposer(), f"{a.address},{failing.address}", target_wait_s=10)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await tokens(stub, prefill(failing, "s", failing.address, max_new_tokens=6))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
            trailers = dict(err.value.trailing_metadata())
            assert trailers[FAILED_HOP_KEY] == "target" and trailers[TARGET_ADDRESS_KEY] == failing.address
            # The target's own refusal (NOT_FOUND) is the target's hop too; "" names the first target.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await tokens(stub, prefill(failing, "only-there", "", max_new_tokens=6))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            trailers = dict(err.value.trailing_metadata())
            assert trailers[FAILED_HOP_KEY] == "target" and trailers[TARGET_ADDRESS_KEY] == a.address
            # The draft serves on: the healthy target's sessions are not affected.
            assert len(await tokens(stub, prefill(a, "fine", a.address, max_new_tokens=4))) == 3
    finally:
        await running.stop(0)
        await a.server.stop(None)
        await failing.server.stop(None)


async def test_start_up_takes_any_serving_target(target) -> None:
    absent = f"127.0.0.1:{free_port()}"
    fake = await start_fake_target(target, serving=False)
    try:
        starting = asyncio.create_task(
            start_draft(lambda info: NgramProposer(), f"{absent},{fake.address}", target_wait_s=30)
        )
        await asyncio.sleep(0.6)
        assert not starting.done()  # neither is SERVING yet
        await fake.health.serving()
        running = await asyncio.wait_for(starting, 10)
        assert running.engine.target_info.model_name == fake.service.model_name
        assert running.targets.allowed == [absent, fake.address]
        await running.stop(0)
    finally:
        await fake.server.stop(None)
    with pytest.raises(TargetUnavailableError) as err:
        await start_draft(lambda info: NgramProposer(), f"{absent},127.0.0.1:{free_port()}", target_wait_s=0.5)
    assert absent in str(err.value)


async def test_a_block_written_after_the_target_died_raises_the_calls_own_status():
    """grpc.aio refuses a write on a finished call with InvalidStateError; the draft must pass the
    call's status on (so the caller learns that the target failed), not a bare "RPC already finished"."""
    from draft_service.target_client import GrpcVerifyStream
    from draft_service.types import Proposal, ProposedBlock

    class FinishedCall:
        async def write(self, request):
            raise asyncio.InvalidStateError("RPC already finished.")

        async def code(self):
            return grpc.StatusCode.UNAVAILABLE

        async def initial_metadata(self):
            return grpc.aio.Metadata()

        async def trailing_metadata(self):
            return grpc.aio.Metadata()

        async def details(self):
            return "Socket closed"

    stream = GrpcVerifyStream(FinishedCall())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.verify(ProposedBlock("s", 1, 3, Proposal((4,))))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and info.value.details() == "Socket closed"
