"""The load figures of ``TargetService.Info`` (a gateway places sessions on a pool of targets by
them): live sessions, the KV budget free and in all, and the calls waiting for the batcher."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tandem.models import load_model
from tandem.models.worker import ModelWorker
from tandem.rpc.endpoints import insecure_channel
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service import kv_cache
from target_service.batcher import PassBatcher
from target_service.engine import TargetEngine
from target_service.main import start_target

PROMPT = [5, 17, 42, 99, 123, 7, 250, 31]
NEW_TOKENS = 8
BUDGET_POSITIONS = 100


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return load_model(str(tiny_dir), device="cpu", dtype="float32")


def prefill_request(session_id: str) -> target_pb2.PrefillRequest:
    params = common_pb2.SessionParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return target_pb2.PrefillRequest(session_id=session_id, prompt_token_ids=PROMPT, params=params)


async def test_info_reports_sessions_and_the_kv_budget_they_reserve(loaded) -> None:
    per_position = kv_cache.bytes_per_position(loaded.model.config.get_text_config(), torch.float32)
    engine = TargetEngine(loaded, kv_cache_bytes=per_position * BUDGET_POSITIONS)
    running = await start_target(engine)
    async with insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)

        async def load() -> tuple[int, int, int, int]:
            info = await stub.Info(target_pb2.TargetServiceInfoRequest())
            return info.active_sessions, info.kv_free_tokens, info.kv_capacity_tokens, info.queued_passes

        assert await load() == (0, BUDGET_POSITIONS, BUDGET_POSITIONS, 0)
        reserve = len(PROMPT) + NEW_TOKENS  # a session reserves the most it can come to hold
        await stub.Prefill(prefill_request("a"))
        assert await load() == (1, BUDGET_POSITIONS - reserve, BUDGET_POSITIONS, 0)
        await stub.Prefill(prefill_request("b"))
        assert await load() == (2, BUDGET_POSITIONS - 2 * reserve, BUDGET_POSITIONS, 0)
        assert (await stub.Release(target_pb2.ReleaseRequest(session_id="a"))).released
        assert (await stub.Release(target_pb2.ReleaseRequest(session_id="b"))).released
        assert await load() == (0, BUDGET_POSITIONS, BUDGET_POSITIONS, 0)
    await running.stop()


async def test_a_finished_session_holds_no_kv_and_no_budget_reads_zero(loaded) -> None:
    running = await start_target(TargetEngine(loaded))  # no KV budget configured
    async with insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        await stub.Prefill(prefill_request("s"))
        info = await stub.Info(target_pb2.TargetServiceInfoRequest())
        assert (info.active_sessions, info.kv_free_tokens, info.kv_capacity_tokens) == (1, 0, 0)
        request = target_pb2.TargetServiceGenerateRequest(session_id="s")  # to its budget: it finishes
        async for _ in stub.Generate(request):
            pass
        assert (await stub.Info(target_pb2.TargetServiceInfoRequest())).active_sessions == 0
    await running.stop()


class _Call:
    def __init__(self, session_id: str) -> None:
        self.session_id = session_id


async def test_the_batcher_counts_calls_waiting_for_a_pass() -> None:
    worker = ModelWorker("test-batcher")
    batcher = PassBatcher(worker, lambda calls: [c.session_id for c in calls], max_tokens=64)
    gate = threading.Event()
    worker.submit(gate.wait)  # the model thread is busy: calls queue up
    try:
        runs = [asyncio.ensure_future(batcher.run(_Call(f"s{i}"), 1)) for i in range(3)]
        await asyncio.sleep(0)
        assert batcher.queued == 3
    finally:
        gate.set()
    assert await asyncio.gather(*runs) == ["s0", "s1", "s2"]
    assert batcher.queued == 0
    worker.shutdown()
