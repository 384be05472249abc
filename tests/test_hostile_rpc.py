"""Hostile input on the internal RPCs, beyond the bad-input tables of test_target_grpc.py and
test_draft_server.py: a Verify stream that changes session, one that sends 10,000 blocks without
reading a verdict, and property-based tests (hypothesis) over every field of the target's and the
draft's request messages. Whatever arrives, the answer is a status naming the problem (never
INTERNAL or UNKNOWN), and a session that was there before verifies to the reference tokens after."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import pytest
from draft_fakes import generate_greedy, load_tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draft_service.main import start_draft
from draft_service.proposers.ngram import NgramProposer
from tandem.models import tokenizer_fingerprint
from tandem.telemetry.metrics import make_metrics
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine
from target_service.main import start_target

T = TypeVar("T")
PROMPT = [5, 17, 42, 99, 123, 7, 250, 31, 64, 11, 200, 150]
# What a refusal may be; INTERNAL or UNKNOWN would be a bug the input found.
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.OUT_OF_RANGE}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True)


class LoopThread:
    """An event loop on a thread of its own, serving while synchronous (hypothesis) tests call."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return load_tiny(tiny_dir)


@pytest.fixture(scope="module")
def services(llama):
    """A target and an ngram draft before it, served from a background loop."""
    background = LoopThread()
    target = background.run(start_target(TargetEngine(llama, metrics=make_metrics("target"))))
    target_address = f"127.0.0.1:{target.port}"
    draft = background.run(start_draft(lambda info: NgramProposer(), target_address, num_speculative_tokens=4,
                                       target_wait_s=30))
    yield target, draft, target_address, f"127.0.0.1:{draft.port}"
    background.run(draft.stop(0))
    background.run(target.stop(0))
    background.close()


@pytest.fixture(scope="module")
def reference(llama) -> list[int]:
    return generate_greedy(llama.model, PROMPT, 24, None)


def params(max_new_tokens: int = 24, **sampling) -> common_pb2.SessionParams:
    return common_pb2.SessionParams(sampling=common_pb2.SamplingParams(**sampling), max_new_tokens=max_new_tokens,
                                    ignore_eos=True)


class Victim:
    """A session opened before the hostile input; each ``check`` verifies its next valid block and
    compares what it commits with the reference (the model's own greedy tokens)."""

    def __init__(self, stub: target_pb2_grpc.TargetServiceStub, reference: list[int]) -> None:
        self.stub, self.reference = stub, reference
        self.session_id = f"victim-{uuid.uuid4().hex}"
        first = stub.Prefill(target_pb2.PrefillRequest(session_id=self.session_id, prompt_token_ids=PROMPT,
                                                       params=params()), timeout=30)
        assert first.token_id == reference[0]
        self.generated = [first.token_id]

    def check(self) -> None:
        done = len(self.generated)
        if done + 3 > len(self.reference):
            return
        block = target_pb2.VerifyRequest(session_id=self.session_id, base_len=len(PROMPT) + done,
                                         draft_token_ids=self.reference[done:done + 2])
        (verdict,) = list(self.stub.Verify(iter([block]), timeout=30))
        assert verdict.status == target_pb2.VERDICT_STATUS_OK
        self.generated += list(verdict.committed_token_ids)
        assert self.generated == self.reference[:len(self.generated)]


@pytest.fixture(scope="module")
def target_stub(services):
    _, _, target_address, _ = services
    with grpc.insecure_channel(target_address) as channel:
        yield target_pb2_grpc.TargetServiceStub(channel)


def refused_or_served(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as error:
        assert error.code() in REFUSALS, (error.code(), error.details())
        assert error.details(), error.code()
        return error.code()
    return grpc.StatusCode.OK


# ------------------------------------------------------------------------------ Verify streams


def test_a_verify_stream_serves_one_session(target_stub, reference):
    victim, other = Victim(target_stub, reference), Victim(target_stub, reference)
    n = len(PROMPT) + 1
    blocks = [target_pb2.VerifyRequest(session_id=victim.session_id, base_len=n, block_id=1),
              target_pb2.VerifyRequest(session_id=other.session_id, base_len=n, block_id=2)]
    with pytest.raises(grpc.RpcError) as refused:
        list(target_stub.Verify(iter(blocks), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in refused.value.details()
    other.check()  # the session the stream tried to switch to was not touched
    victim.generated.append(reference[1])  # the first block (no drafts) committed the target's own token
    victim.check()


async def test_ten_thousand_blocks_unread_hold_up_no_other_session(llama, reference):
    target = await start_target(TargetEngine(llama, metrics=make_metrics("target")))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{target.port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            flood_id, fair_id = f"flood-{uuid.uuid4().hex}", f"fair-{uuid.uuid4().hex}"
            for sid in (flood_id, fair_id):
                await stub.Prefill(target_pb2.PrefillRequest(session_id=sid, prompt_token_ids=PROMPT, params=params()))
            n = len(PROMPT) + 1
            # The same block 10,000 times: the first is verified, the others are stale (no pass).
            flood = [target_pb2.VerifyRequest(session_id=flood_id, base_len=n, draft_token_ids=reference[1:3],
                                              block_id=i) for i in range(10_000)]
            unread = stub.Verify(iter(flood))  # never read
            await asyncio.sleep(0.5)
            # Meanwhile another session's blocks are verified as usual, each promptly.
            fair = stub.Verify()
            committed = [reference[0]]
            for _ in range(5):
                started = time.monotonic()
                await fair.write(target_pb2.VerifyRequest(session_id=fair_id, base_len=len(PROMPT) + len(committed),
                                                          draft_token_ids=reference[len(committed):len(committed) + 2]))
                verdict = await asyncio.wait_for(fair.read(), 30)
                assert verdict.status == target_pb2.VERDICT_STATUS_OK and time.monotonic() - started < 10
                committed += list(verdict.committed_token_ids)
            await fair.done_writing()
            assert committed == reference[:len(committed)]
            unread.cancel()
            # The flooded session is intact: it committed the first block only.
            verdicts = [v async for v in stub.Verify(iter([target_pb2.VerifyRequest(
                session_id=flood_id, base_len=n + 3, draft_token_ids=reference[4:6])]))]
            assert verdicts[0].status == target_pb2.VERDICT_STATUS_OK
            assert list(verdicts[0].committed_token_ids) == reference[4:7]
    finally:
        await target.stop(0)


# ------------------------------------------------------------------------------ property-based

session_ids = st.one_of(st.just(""), st.text(max_size=40), st.text(min_size=300, max_size=400),
                        st.just("victim-does-not-exist"))
token_lists = st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=12)
small_tokens = st.lists(st.integers(min_value=-2, max_value=320), max_size=8)
probabilities = st.floats(allow_nan=True, allow_infinity=True, width=32)
sparse = st.builds(common_pb2.SparseDistribution, token_ids=small_tokens, probs=st.lists(probabilities, max_size=8))
sampling = st.builds(common_pb2.SamplingParams, temperature=probabilities, top_p=probabilities,
                     top_k=st.integers(min_value=-5, max_value=400))
session_params = st.builds(common_pb2.SessionParams, sampling=sampling,
                           max_new_tokens=st.integers(min_value=-10, max_value=5000), ignore_eos=st.booleans(),
                           stop_token_ids=small_tokens)


@FUZZ
@given(session_id=session_ids, prompt=st.one_of(token_lists, small_tokens), session=session_params,
       fingerprint=st.one_of(st.just(""), st.text(max_size=40)), hidden=st.booleans())
def test_any_prefill_is_served_or_refused_by_name(target_stub, reference, session_id, prompt, session, fingerprint,
                                                  hidden):
    victim = Victim(target_stub, reference)
    request = target_pb2.PrefillRequest(session_id=session_id, prompt_token_ids=prompt, params=session,
                                        tokenizer_fingerprint=fingerprint, return_hidden_states=hidden)
    if refused_or_served(lambda: target_stub.Prefill(request, timeout=60)) == grpc.StatusCode.OK:
        target_stub.Release(target_pb2.ReleaseRequest(session_id=session_id), timeout=30)
    victim.check()
    target_stub.Release(target_pb2.ReleaseRequest(session_id=victim.session_id), timeout=30)


@FUZZ
@given(base=st.integers(min_value=-3, max_value=40), assumed=small_tokens, drafts=small_tokens,
       parents=st.lists(st.integers(min_value=-3, max_value=9), max_size=8), probs=st.lists(sparse, max_size=4),
       other_session=st.one_of(st.none(), session_ids), hidden=st.booleans())
def test_any_block_is_verified_or_refused_by_name_and_the_session_goes_on(target_stub, reference, base, assumed,
                                                                          drafts, parents, probs, other_session,
                                                                          hidden):
    victim = Victim(target_stub, reference)
    block = target_pb2.VerifyRequest(
        session_id=victim.session_id if other_session is None else other_session, base_len=base,
        assumed_token_ids=assumed, draft_token_ids=drafts, draft_parents=parents, draft_probs=probs,
        return_hidden_states=hidden)
    outcome: list[target_pb2.VerifyResponse] = []
    refused_or_served(lambda: outcome.extend(target_stub.Verify(iter([block]), timeout=60)))
    if outcome and outcome[0].status == target_pb2.VERDICT_STATUS_OK and other_session is None:
        # A block that happened to be valid committed tokens: the reference says which.
        committed = list(outcome[0].committed_token_ids)
        assert victim.generated + committed == reference[:len(victim.generated) + len(committed)]
        victim.generated += committed
    victim.check()
    target_stub.Release(target_pb2.ReleaseRequest(session_id=victim.session_id), timeout=30)


@FUZZ
@given(session_id=session_ids, budget=st.integers(min_value=-(2**31), max_value=2**31 - 1))
def test_any_generate_or_release_is_served_or_refused_by_name(target_stub, reference, session_id, budget):
    victim = Victim(target_stub, reference)
    refused_or_served(lambda: list(target_stub.Generate(target_pb2.TargetServiceGenerateRequest(
        session_id=session_id, max_new_tokens=budget), timeout=60)))
    refused_or_served(lambda: target_stub.Release(target_pb2.ReleaseRequest(session_id=session_id), timeout=30))
    victim.check()
    target_stub.Release(target_pb2.ReleaseRequest(session_id=victim.session_id), timeout=30)


@FUZZ
@given(session_id=session_ids, tokens=st.one_of(token_lists, small_tokens), prompt_len=st.integers(-3, 20),
       session=session_params, k=st.integers(min_value=-3, max_value=80), budget=st.integers(-3, 30),
       fingerprint=st.one_of(st.just(""), st.text(max_size=10)),
       address=st.one_of(st.just(""), st.text(max_size=30), st.just("127.0.0.1:1")))
def test_any_speculate_is_served_or_refused_by_name(services, target_stub, reference, llama, session_id, tokens,
                                                    prompt_len, session, k, budget, fingerprint, address):
    _, _, _, draft_address = services
    victim = Victim(target_stub, reference)
    request = draft_pb2.SpeculateRequest(session_id=session_id, token_ids=tokens, prompt_len=prompt_len,
                                         params=session, num_speculative_tokens=k, max_new_tokens=budget,
                                         tokenizer_fingerprint=fingerprint or tokenizer_fingerprint(llama.tokenizer),
                                         target_address=address)
    with grpc.insecure_channel(draft_address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        refused_or_served(lambda: list(stub.Speculate(request, timeout=60)))
        # The victim, speculated by the draft, still gets exactly the reference tokens.
        spec = draft_pb2.SpeculateRequest(session_id=victim.session_id, token_ids=[*PROMPT, reference[0]],
                                          prompt_len=len(PROMPT), params=params(),
                                          tokenizer_fingerprint=tokenizer_fingerprint(llama.tokenizer))
        tokens_out = [t for r in stub.Speculate(spec, timeout=60) for t in r.token_ids]
    assert [reference[0], *tokens_out] == reference
    target_stub.Release(target_pb2.ReleaseRequest(session_id=victim.session_id), timeout=30)
