"""TargetService over real gRPC (in-process server on port 0): the round trip, health and
reflection, cancellation, TTL, and the bad-input table (each error has the right status code and
the next valid call succeeds)."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
import uuid

import grpc
import httpx
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.tools.bench.stack import free_ports
from tandem.rpc.endpoints import insecure_channel
from tandem.telemetry.metrics import make_metrics
from tandem.models import load_model
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.engine import PrefillJob, TargetEngine
from target_service.main import start_target
from target_service.session import SessionConfig

PROMPT = [5, 17, 42, 99, 123, 7, 250, 31, 64, 11, 200, 150]


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return load_model(str(tiny_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def engine(loaded) -> TargetEngine:
    return TargetEngine(loaded, metrics=make_metrics("target"))


@pytest.fixture
async def stub(engine):
    running = await start_target(engine)
    channel = insecure_channel(f"127.0.0.1:{running.port}")
    yield target_pb2_grpc.TargetServiceStub(channel)
    await channel.close()
    await running.stop()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def new_id() -> str:
    return uuid.uuid4().hex


def prefill_request(session_id: str, max_new_tokens: int = 24, **sampling) -> target_pb2.PrefillRequest:
    return target_pb2.PrefillRequest(
        session_id=session_id,
        prompt_token_ids=PROMPT,
        params=common_pb2.SessionParams(
            sampling=common_pb2.SamplingParams(**sampling), max_new_tokens=max_new_tokens, ignore_eos=True
        ),
    )


async def verify_all(stub, requests: list[target_pb2.VerifyRequest]) -> list[target_pb2.VerifyResponse]:
    """Sends every block at once (pipelined) and collects the verdicts."""

    async def blocks():
        for request in requests:
            yield request

    return [verdict async for verdict in stub.Verify(blocks())]


# --------------------------------------------------------------------------- happy paths


async def test_info_health_and_reflection(engine) -> None:
    running = await start_target(engine)
    async with insecure_channel(f"127.0.0.1:{running.port}") as channel:
        info = await target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.TargetServiceInfoRequest())
        assert (info.vocab_size, info.hidden_size, info.dtype, info.device) == (300, 32, "float32", "cpu")
        assert info.tokenizer_fingerprint == engine.info.tokenizer_fingerprint and len(info.tokenizer_fingerprint) == 32
        assert info.verifier_backend == "rowwise" and info.max_context_len == 2048
        assert list(info.eos_token_ids) == [1] and info.model_name == engine.info.model_name
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="tandem.v1.TargetService"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
        await reflection.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        reply = await reflection.read()
        await reflection.done_writing()
        assert "tandem.v1.TargetService" in [s.name for s in reply.list_services_response.service]
    await running.stop()


async def test_not_serving_until_a_model_is_attached(engine) -> None:
    running = await start_target(None)
    async with insecure_channel(f"127.0.0.1:{running.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.NOT_SERVING
        stub = target_pb2_grpc.TargetServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Info(target_pb2.TargetServiceInfoRequest())
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        await running.attach(engine)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
        assert (await stub.Info(target_pb2.TargetServiceInfoRequest())).vocab_size == 300
    await running.stop()


async def test_prefill_verify_generate_release_round_trip(stub, loaded) -> None:
    reference = hf_greedy(loaded.model, PROMPT, 24)
    sid = new_id()
    request = prefill_request(sid)
    request.return_hidden_states = True
    first = await stub.Prefill(request)
    assert (first.token_id, first.committed_len) == (reference[0], len(PROMPT) + 1)
    assert list(first.hidden_states.shape) == [len(PROMPT), 32] and first.hidden_states.dtype == "float16"
    assert len(first.hidden_states.data) == len(PROMPT) * 32 * 2
    assert np.isfinite(np.frombuffer(first.hidden_states.data, dtype="<f2")).all()

    n = len(PROMPT) + 1
    verdicts = await verify_all(stub, [
        # The target's own tokens: fully accepted (4 + bonus).
        target_pb2.VerifyRequest(session_id=sid, base_len=n, draft_token_ids=reference[1:5], block_id=1),
        # Pipelined before verdict 1: assumes block 1 fully accepted plus its bonus token.
        target_pb2.VerifyRequest(session_id=sid, base_len=n, assumed_token_ids=reference[1:6],
                                 draft_token_ids=[reference[6], (reference[7] + 1) % 300], block_id=2),
        # Built on a stale view of the session.
        target_pb2.VerifyRequest(session_id=sid, base_len=n, draft_token_ids=[1, 2], block_id=3),
    ])
    assert [v.block_id for v in verdicts] == [1, 2, 3]
    assert [v.status for v in verdicts] == [target_pb2.VERDICT_STATUS_OK] * 2 + [target_pb2.VERDICT_STATUS_STALE]
    assert (verdicts[0].num_accepted, list(verdicts[0].committed_token_ids)) == (4, reference[1:6])
    assert (verdicts[1].num_accepted, list(verdicts[1].committed_token_ids)) == (1, reference[6:8])
    assert verdicts[0].verify_seconds > 0 and list(verdicts[1].hidden_states.shape) == [2, 32]
    assert verdicts[2].committed_len == verdicts[1].committed_len == n + 7

    chunks = [c async for c in stub.Generate(target_pb2.TargetServiceGenerateRequest(session_id=sid, max_new_tokens=5))]
    assert [len(c.token_ids) for c in chunks] == [1] * 5
    assert chunks[-1].committed_len == n + 12
    rest = [c async for c in stub.Generate(target_pb2.TargetServiceGenerateRequest(session_id=sid))]  # until finish
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    generated = [first.token_id, *verdicts[0].committed_token_ids, *verdicts[1].committed_token_ids]
    generated += [t for c in chunks + rest for t in c.token_ids]
    assert generated == reference

    finished = await verify_all(stub, [target_pb2.VerifyRequest(session_id=sid, base_len=len(PROMPT) + 24, draft_token_ids=[3])])
    assert finished[0].status == target_pb2.VERDICT_STATUS_FINISHED
    assert (await stub.Release(target_pb2.ReleaseRequest(session_id=sid))).released is True
    assert (await stub.Release(target_pb2.ReleaseRequest(session_id=sid))).released is False


async def test_hidden_states_asked_per_block(stub, loaded) -> None:
    """A session prefilled without hidden states returns them for the blocks that ask, including
    an empty block (one committed token, one row); the others carry none."""
    reference = hf_greedy(loaded.model, PROMPT, 24)
    sid = new_id()
    first = await stub.Prefill(prefill_request(sid))
    assert not first.HasField("hidden_states")
    n = first.committed_len
    verdicts = await verify_all(stub, [
        target_pb2.VerifyRequest(session_id=sid, base_len=n, block_id=1, return_hidden_states=True),
        target_pb2.VerifyRequest(session_id=sid, base_len=n, assumed_token_ids=reference[1:2],
                                 draft_token_ids=reference[2:4], block_id=2, return_hidden_states=True),
        target_pb2.VerifyRequest(session_id=sid, base_len=n + 4, draft_token_ids=reference[5:6], block_id=3),
    ])
    assert [v.status for v in verdicts] == [target_pb2.VERDICT_STATUS_OK] * 3
    assert list(verdicts[0].committed_token_ids) == reference[1:2]
    assert list(verdicts[1].committed_token_ids) == reference[2:5]
    assert not verdicts[2].HasField("hidden_states")
    rows = [np.frombuffer(v.hidden_states.data, dtype="<f2").reshape(list(v.hidden_states.shape)) for v in verdicts[:2]]
    assert [r.shape for r in rows] == [(1, 32), (3, 32)]
    with torch.inference_mode():
        sequence = PROMPT + reference[:5]
        fresh = loaded.model(torch.tensor([sequence]), output_hidden_states=True).hidden_states[-1][0]
    # Row i is the state at the position whose logits produced committed token i.
    expected = fresh[len(PROMPT) : len(PROMPT) + 4].half().float().numpy()
    np.testing.assert_allclose(np.concatenate(rows).astype("float32"), expected, atol=2e-2, rtol=1e-2)
    await stub.Release(target_pb2.ReleaseRequest(session_id=sid))


async def test_sampled_session_with_sparse_draft_probs(stub) -> None:
    sid = new_id()
    first = await stub.Prefill(prefill_request(sid, temperature=1.0, top_p=0.9, top_k=50, seed=3))
    q = common_pb2.SparseDistribution(token_ids=[7, 8, 9], probs=[0.5, 0.25, 0.25])
    verdicts = await verify_all(stub, [target_pb2.VerifyRequest(
        session_id=sid, base_len=first.committed_len, draft_token_ids=[7, 9], draft_probs=[q, q])])
    assert verdicts[0].status == target_pb2.VERDICT_STATUS_OK
    assert 1 <= len(verdicts[0].committed_token_ids) <= 3
    await stub.Release(target_pb2.ReleaseRequest(session_id=sid))


async def test_cancelled_generate_stops_and_the_session_lives_on(stub, loaded, engine) -> None:
    sid = new_id()
    budget = 2000  # far more than the stream runs ahead of the client before the cancel lands
    await stub.Prefill(prefill_request(sid, max_new_tokens=budget))
    call = stub.Generate(target_pb2.TargetServiceGenerateRequest(session_id=sid))
    for _ in range(3):
        await call.read()
    call.cancel()
    session = engine.store.get(sid)
    deadline, seen = time.monotonic() + 10, -1
    while session.committed_len != seen:  # wait until it stops growing
        assert time.monotonic() < deadline, "the session kept growing after the client cancelled"
        seen = session.committed_len
        await asyncio.sleep(0.2)
    assert not session.finished and seen < len(PROMPT) + budget
    chunks = [c async for c in stub.Generate(target_pb2.TargetServiceGenerateRequest(session_id=sid, max_new_tokens=4))]
    assert chunks[-1].committed_len == seen + 4
    produced = session.tokens[len(PROMPT) :]
    assert produced == hf_greedy(loaded.model, PROMPT, len(produced))  # nothing lost or duplicated
    await stub.Release(target_pb2.ReleaseRequest(session_id=sid))


async def test_idle_sessions_expire(loaded) -> None:
    metrics = make_metrics("target")
    engine = TargetEngine(loaded, session_ttl_s=0.2, metrics=metrics)
    running = await start_target(engine)
    async with insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        await stub.Prefill(prefill_request("idle"))
        assert metrics.sessions_active.labels(mode="target")._value.get() == 1
        await asyncio.sleep(0.6)
        assert metrics.sessions_active.labels(mode="target")._value.get() == 0  # the reaper ran
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await verify_all(stub, [target_pb2.VerifyRequest(session_id="idle", base_len=13, draft_token_ids=[1])])
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
    await running.stop()


async def test_too_many_sessions(loaded) -> None:
    running = await start_target(TargetEngine(loaded, max_sessions=1))
    async with insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        await stub.Prefill(prefill_request("one"))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Prefill(prefill_request("two"))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await stub.Release(target_pb2.ReleaseRequest(session_id="one"))
        await stub.Prefill(prefill_request("two"))
    await running.stop()


# --------------------------------------------------------------------------- bad input


BAD_PREFILLS = [  # (name, how to spoil a valid PrefillRequest, expected code)
    ("empty session id", lambda r: setattr(r, "session_id", ""), grpc.StatusCode.INVALID_ARGUMENT),
    ("10 kB session id", lambda r: setattr(r, "session_id", "x" * 10_240), grpc.StatusCode.INVALID_ARGUMENT),
    ("over the 16 MiB request limit", lambda r: setattr(r, "tokenizer_fingerprint", "f" * (17 << 20)),
     grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("empty prompt", lambda r: r.ClearField("prompt_token_ids"), grpc.StatusCode.INVALID_ARGUMENT),
    ("token id >= vocab", lambda r: r.prompt_token_ids.append(300), grpc.StatusCode.INVALID_ARGUMENT),
    ("negative token id", lambda r: r.prompt_token_ids.append(-1), grpc.StatusCode.INVALID_ARGUMENT),
    ("longer than the context", lambda r: setattr(r.params, "max_new_tokens", 2040), grpc.StatusCode.INVALID_ARGUMENT),
    ("max_new_tokens 0", lambda r: setattr(r.params, "max_new_tokens", 0), grpc.StatusCode.INVALID_ARGUMENT),
    ("max_new_tokens < 0", lambda r: setattr(r.params, "max_new_tokens", -5), grpc.StatusCode.INVALID_ARGUMENT),
    ("temperature < 0", lambda r: setattr(r.params.sampling, "temperature", -0.5), grpc.StatusCode.INVALID_ARGUMENT),
    ("temperature NaN", lambda r: setattr(r.params.sampling, "temperature", math.nan), grpc.StatusCode.INVALID_ARGUMENT),
    ("top_p > 1", lambda r: setattr(r.params.sampling, "top_p", 1.5), grpc.StatusCode.INVALID_ARGUMENT),
    ("top_p < 0", lambda r: setattr(r.params.sampling, "top_p", -0.1), grpc.StatusCode.INVALID_ARGUMENT),
    ("top_k < 0", lambda r: setattr(r.params.sampling, "top_k", -1), grpc.StatusCode.INVALID_ARGUMENT),
    ("stop token >= vocab", lambda r: r.params.stop_token_ids.append(999), grpc.StatusCode.INVALID_ARGUMENT),
    ("other tokenizer", lambda r: setattr(r, "tokenizer_fingerprint", "0" * 32), grpc.StatusCode.FAILED_PRECONDITION),
]


@pytest.mark.parametrize("spoil, code", [pytest.param(s, c, id=name) for name, s, c in BAD_PREFILLS])
async def test_bad_prefill_is_refused_and_service_goes_on(stub, engine, spoil, code) -> None:
    request = prefill_request(new_id())
    spoil(request)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Prefill(request)
    assert error.value.code() == code and error.value.details()
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        details = error.value.details()
        assert engine.info.model_name in details and engine.info.tokenizer_fingerprint in details and "0" * 32 in details
    sid = new_id()
    assert (await stub.Prefill(prefill_request(sid))).committed_len == len(PROMPT) + 1
    assert (await stub.Release(target_pb2.ReleaseRequest(session_id=sid))).released


def _q(ids, probs):
    return common_pb2.SparseDistribution(token_ids=ids, probs=probs)


BAD_BLOCKS = [  # (name, VerifyRequest fields, code); session "s" has committed_len = len(PROMPT) + 1
    ("unknown session", {"session_id": "nope", "draft_token_ids": [1]}, grpc.StatusCode.NOT_FOUND),
    ("empty session id", {"session_id": "", "draft_token_ids": [1]}, grpc.StatusCode.INVALID_ARGUMENT),
    ("10 kB session id", {"session_id": "s" * 10_240, "draft_token_ids": [1]}, grpc.StatusCode.INVALID_ARGUMENT),
    ("draft token >= vocab", {"draft_token_ids": [300]}, grpc.StatusCode.INVALID_ARGUMENT),
    ("negative draft token", {"draft_token_ids": [-3]}, grpc.StatusCode.INVALID_ARGUMENT),
    ("assumed token >= vocab", {"assumed_token_ids": [300], "draft_token_ids": [1]}, grpc.StatusCode.INVALID_ARGUMENT),
    ("more drafts than a block carries", {"draft_token_ids": [1] * 65}, grpc.StatusCode.INVALID_ARGUMENT),
    ("negative base_len", {"base_len": -1, "draft_token_ids": [1]}, grpc.StatusCode.INVALID_ARGUMENT),
    ("base_len past the committed length", {"base_len": len(PROMPT) + 9, "draft_token_ids": [1]},
     grpc.StatusCode.INVALID_ARGUMENT),
    ("tree: a node its own parent (a cycle)", {"draft_token_ids": [1, 2], "draft_parents": [-1, 1]},
     grpc.StatusCode.INVALID_ARGUMENT),
    ("tree: a forward reference", {"draft_token_ids": [1, 2], "draft_parents": [1, -1]}, grpc.StatusCode.INVALID_ARGUMENT),
    ("tree: a parent out of range", {"draft_token_ids": [1, 2], "draft_parents": [-1, -7]},
     grpc.StatusCode.INVALID_ARGUMENT),
    ("tree: parents and tokens differ in length", {"draft_token_ids": [1, 2], "draft_parents": [-1]},
     grpc.StatusCode.INVALID_ARGUMENT),
    ("tree: more nodes than a block carries", {"draft_token_ids": list(range(65)), "draft_parents": [-1] * 65},
     grpc.StatusCode.INVALID_ARGUMENT),
    ("NaN q", {"draft_token_ids": [1], "draft_probs": [_q([1, 2], [math.nan, 1.0])]}, grpc.StatusCode.INVALID_ARGUMENT),
    ("q without the draft token", {"draft_token_ids": [1], "draft_probs": [_q([2], [1.0])]},
     grpc.StatusCode.INVALID_ARGUMENT),
    ("fewer draft_probs than tokens", {"draft_token_ids": [1, 2], "draft_probs": [_q([1], [1.0])]},
     grpc.StatusCode.INVALID_ARGUMENT),
    ("q id >= vocab", {"draft_token_ids": [1], "draft_probs": [_q([1, 301], [0.5, 0.5])]}, grpc.StatusCode.INVALID_ARGUMENT),
    ("negative q", {"draft_token_ids": [1], "draft_probs": [_q([1, 2], [1.5, -0.5])]}, grpc.StatusCode.INVALID_ARGUMENT),
    ("q ids and probs differ in length", {"draft_token_ids": [1], "draft_probs": [_q([1, 2], [1.0])]},
     grpc.StatusCode.INVALID_ARGUMENT),
    ("q not summing to 1", {"draft_token_ids": [1], "draft_probs": [_q([1, 2], [0.2, 0.2])]}, grpc.StatusCode.INVALID_ARGUMENT),
    ("other tokenizer", {"draft_token_ids": [1], "tokenizer_fingerprint": "0" * 32}, grpc.StatusCode.FAILED_PRECONDITION),
]


@pytest.mark.parametrize("fields, code", [pytest.param(f, c, id=name) for name, f, c in BAD_BLOCKS])
async def test_bad_block_is_refused_and_service_goes_on(stub, loaded, fields, code) -> None:
    reference = hf_greedy(loaded.model, PROMPT, 6)
    sid = new_id()
    await stub.Prefill(prefill_request(sid))
    request = target_pb2.VerifyRequest(**{"session_id": sid, "base_len": len(PROMPT) + 1, **fields})
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await verify_all(stub, [request])
    assert error.value.code() == code and error.value.details()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert any(field in error.value.details() for field in fields), error.value.details()  # names the field
    # The session was not touched: the next valid block verifies to the reference tokens.
    ok = await verify_all(stub, [target_pb2.VerifyRequest(session_id=sid, base_len=len(PROMPT) + 1,
                                                          draft_token_ids=reference[1:4])])
    assert ok[0].status == target_pb2.VERDICT_STATUS_OK
    assert list(ok[0].committed_token_ids) == reference[1:5]


async def test_a_long_prefill_runs_in_chunks_between_other_sessions_steps(loaded) -> None:
    """Prefill over gRPC is one pass per chunk, so a session that is decoding keeps getting steps
    while a long prompt is prefilled (in passes of their own or shared with a chunk), and the
    prefill's answer is that of one pass."""
    engine = TargetEngine(loaded, prefill_chunk_tokens=2)
    passes: list[set[str]] = []  # what each pass ran: "prefill" chunks, "step"s
    run_batch = engine.run_batch

    def recorded(calls):  # each pass takes 5 ms, as a pass of a real model would take longer
        passes.append({"prefill" if isinstance(call, PrefillJob) else "step" for call in calls})
        time.sleep(0.005)
        return run_batch(calls)

    engine.run_batch = recorded
    running = await start_target(engine)  # after the patches: the server's batcher takes engine.run_batch
    long_prompt = [(7 * i) % 290 + 5 for i in range(40)]
    try:
        async with insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            decoding = new_id()
            await stub.Prefill(prefill_request(decoding, max_new_tokens=64))
            passes.clear()
            stream = stub.Generate(target_pb2.TargetServiceGenerateRequest(session_id=decoding, max_new_tokens=40))
            steps = asyncio.ensure_future(_collect(stream))
            await asyncio.sleep(0.02)  # the stream is stepping
            request = prefill_request(new_id(), max_new_tokens=8)
            request.prompt_token_ids[:] = long_prompt
            answer = await stub.Prefill(request)
            await steps
    finally:
        await running.stop()
    chunks = [i for i, kinds in enumerate(passes) if "prefill" in kinds]
    assert len(chunks) == 20  # one pass per chunk
    during = passes[chunks[0] : chunks[-1] + 1]
    assert sum("step" in kinds for kinds in during) >= 10  # the decoding session kept stepping meanwhile
    one_pass = TargetEngine(loaded, prefill_chunk_tokens=0).prefill("x", long_prompt, SessionConfig(max_new_tokens=8))
    assert (answer.token_id, answer.committed_len) == (one_pass.token_id, 41)


async def _collect(stream) -> list:
    return [message async for message in stream]


async def test_bad_generate_and_release(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        [c async for c in stub.Generate(target_pb2.TargetServiceGenerateRequest(session_id="nope"))]
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    for session_id in ("", "x" * 10_240):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [c async for c in stub.Generate(target_pb2.TargetServiceGenerateRequest(session_id=session_id))]
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in error.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Release(target_pb2.ReleaseRequest(session_id=session_id))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in error.value.details()
        assert len(error.value.details()) < 300  # the id is not echoed back
    sid = new_id()
    await stub.Prefill(prefill_request(sid))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        [c async for c in stub.Generate(target_pb2.TargetServiceGenerateRequest(session_id=sid, max_new_tokens=-1))]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await stub.Release(target_pb2.ReleaseRequest(session_id="never-existed"))).released is False
    chunks = [c async for c in stub.Generate(target_pb2.TargetServiceGenerateRequest(session_id=sid, max_new_tokens=2))]
    assert len(chunks) == 2


async def test_duplicate_session_id(stub) -> None:
    sid = new_id()
    await stub.Prefill(prefill_request(sid))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Prefill(prefill_request(sid))
    assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert (await stub.Release(target_pb2.ReleaseRequest(session_id=sid))).released


# --------------------------------------------------------------------------- the process entry point


def test_run_serves_until_sigterm(tiny_dir) -> None:
    """``tandem target`` serves until SIGTERM, then exits 0 (skipping the interpreter's teardown:
    tandem.cli) with its log written to the end."""
    port, metrics_port = free_ports(2)
    argv = [sys.executable, "-m", "tandem.cli", "target", "--target-model", str(tiny_dir), "--port", str(port),
            "--metrics-port", str(metrics_port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") or k == "TANDEM_CACHE_DIR"}
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, process.stdout.read().decode()
                try:
                    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "the target never became SERVING"
                time.sleep(0.2)
            info = target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.TargetServiceInfoRequest(), timeout=5)
            assert info.model_name == tiny_dir.name and info.vocab_size == 300
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert 'tandem_sessions_active{mode="target"} 0.0' in metrics
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        output = process.stdout.read().decode()
        assert "target_service.main: target stopping" in output, output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_an_internal_failure_is_reported_and_the_service_goes_on(stub, engine, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "model", broken)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Prefill(prefill_request(new_id()))
    assert error.value.code() == grpc.StatusCode.INTERNAL and "simulated failure" in error.value.details()
    sid = new_id()
    assert (await stub.Prefill(prefill_request(sid))).committed_len == len(PROMPT) + 1
    await stub.Release(target_pb2.ReleaseRequest(session_id=sid))
