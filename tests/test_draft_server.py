"""The draft service over real gRPC on loopback, against a fake TargetService (draft_fakes).

The fake target holds sessions the way the gateway leaves them after Prefill; the tests play the
gateway by calling ``DraftService.Speculate`` and check what reaches the client and the target.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from draft_fakes import generate_greedy, load_tiny, start_fake_target
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from draft_service.errors import TargetUnavailableError, TokenizerMismatchError
from draft_service.main import start_draft
from draft_service.proposers.hf import HfProposer
from draft_service.proposers.ngram import NgramProposer
from gateway.errors import TargetNotServed
from gateway.upstream import translate
from tandem.telemetry.metrics import make_metrics
from tandem.models import tokenizer_fingerprint
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

PROMPT = (2, 40, 41, 42, 43, 44, 45, 46)


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_tiny(tiny_dir)


@pytest.fixture(scope="module")
def draft(tiny_draft_dir):
    return load_tiny(tiny_draft_dir)


@pytest.fixture
async def fake_target(target):
    fake = await start_fake_target(target)
    yield fake
    await fake.server.stop(None)


@pytest.fixture
def metrics():
    return make_metrics("draft")


@pytest.fixture
async def ngram_draft(fake_target, metrics):
    running = await start_draft(lambda info: NgramProposer(), fake_target.address, metrics=metrics, target_wait_s=10)
    yield running
    await running.stop(0)


@pytest.fixture
async def hf_draft(fake_target, draft, metrics):
    running = await start_draft(
        lambda info: HfProposer(draft, vocab_limit=info.vocab_size),
        fake_target.address,
        num_speculative_tokens=4,
        metrics=metrics,
        target_wait_s=10,
    )
    yield running
    await running.stop(0)


async def connect(running):
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    return channel, draft_pb2_grpc.DraftServiceStub(channel)


def prefill(fake, session_id="s", max_new_tokens=0, **kwargs) -> draft_pb2.SpeculateRequest:
    """What the gateway does before Speculate: Prefill in the target, then ask the draft."""
    first, _ = fake.service.target.prefill(session_id, PROMPT, max_new_tokens=max_new_tokens)
    sampling = common_pb2.SamplingParams(**kwargs)
    return draft_pb2.SpeculateRequest(
        session_id=session_id,
        token_ids=[*PROMPT, first],
        prompt_len=len(PROMPT),
        params=common_pb2.SessionParams(sampling=sampling, max_new_tokens=max_new_tokens),
        tokenizer_fingerprint=fake.service.fingerprint,
    )


async def speculate(stub, request) -> list[draft_pb2.SpeculateResponse]:
    return [response async for response in stub.Speculate(request)]


def tokens_of(responses) -> list[int]:
    return [token for response in responses for token in response.token_ids]


def active(metrics) -> float:
    return metrics.sessions_active.labels(mode="speculative")._value.get()


async def eventually(condition, timeout_s=5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_speculate_streams_the_targets_greedy_tokens(hf_draft, fake_target, target, metrics):
    n = 24
    request = prefill(fake_target, max_new_tokens=n)
    channel, stub = await connect(hf_draft)
    async with channel:
        responses = await speculate(stub, request)
    expected = generate_greedy(target.model, PROMPT, n, target.tokenizer.eos_token_id)
    assert [request.token_ids[-1], *tokens_of(responses)] == expected
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert responses[-1].committed_len == len(PROMPT) + n
    assert all(r.num_draft_tokens <= 4 and r.round_seconds > 0 for r in responses)
    assert all(r.num_draft_positions == r.num_draft_tokens for r in responses)  # chains
    sent = fake_target.service.requests
    assert all(not r.draft_probs and not r.assumed_token_ids for r in sent)  # greedy blocks: tokens only
    assert {r.tokenizer_fingerprint for r in sent} == {fake_target.service.fingerprint}
    assert metrics.num_drafts._value.get() == len(responses)
    assert metrics.num_draft_tokens._value.get() == sum(r.num_draft_tokens for r in responses)
    # Each verified round's wall time by phase; together they make up the round as the draft timed it.
    phases = {sample.labels["phase"]: sample.value for metric in metrics.round_phase.collect()
              for sample in metric.samples if sample.name.endswith("_sum")}
    counts = {sample.labels["phase"]: sample.value for metric in metrics.round_phase.collect()
              for sample in metric.samples if sample.name.endswith("_count")}
    assert set(phases) == {"propose", "verify", "transport", "other"}
    assert set(counts.values()) == {len(responses)}
    assert phases["propose"] > 0 and phases["transport"] > 0
    assert sum(phases.values()) == pytest.approx(sum(r.round_seconds for r in responses), rel=0.05)
    assert active(metrics) == 0
    assert fake_target.service.released == []  # a finished session is the target's to free


async def test_sampling_blocks_carry_sparse_normalised_q(hf_draft, fake_target):
    request = prefill(fake_target, max_new_tokens=12, temperature=0.8, seed=7)
    channel, stub = await connect(hf_draft)
    async with channel:
        await speculate(stub, request)
    blocks = [r for r in fake_target.service.requests if r.draft_token_ids]
    assert blocks
    for block in blocks:
        assert len(block.draft_probs) == len(block.draft_token_ids)
        for token, q in zip(block.draft_token_ids, block.draft_probs):
            assert token in q.token_ids and len(q.token_ids) <= 32
            assert math.isclose(sum(q.probs), 1.0, abs_tol=1e-5)


async def test_cancelled_speculate_releases_the_target_session(ngram_draft, fake_target, metrics):
    fake_target.service.verify_delay_s = 0.05
    request = prefill(fake_target)  # no budget: runs until cancelled
    channel, stub = await connect(ngram_draft)
    async with channel:
        call = stub.Speculate(request)
        first = await call.read()
        assert first.token_ids
        assert ngram_draft.engine.active_sessions == ["s"] and active(metrics) == 1
        call.cancel()
        await eventually(lambda: fake_target.service.released == ["s"])
    # The release and the draft's own clean-up run concurrently; wait for both.
    await eventually(lambda: ngram_draft.engine.active_sessions == [] and active(metrics) == 0)
    assert "s" not in fake_target.service.target.sessions  # the target freed its KV cache
    # The draft's Verify stream for the session is over, however it ended (cancelled, half-closed,
    # or refused once the session was released under a block in flight).
    assert fake_target.service.streams_opened == 1
    await eventually(lambda: fake_target.service.streams_open == 0)


async def test_a_second_call_for_a_running_session_is_refused(ngram_draft, fake_target):
    fake_target.service.verify_delay_s = 0.05
    request = prefill(fake_target)
    channel, stub = await connect(ngram_draft)
    async with channel:
        call = stub.Speculate(request)
        await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await speculate(stub, request)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        call.cancel()


async def test_tokenizer_fingerprint_mismatch_is_failed_precondition(ngram_draft, fake_target):
    request = prefill(fake_target, max_new_tokens=4)
    request.tokenizer_fingerprint = "0" * 32
    channel, stub = await connect(ngram_draft)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await speculate(stub, request)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "0" * 32 in err.value.details() and fake_target.service.fingerprint in err.value.details()
        request.tokenizer_fingerprint = fake_target.service.fingerprint
        assert len(tokens_of(await speculate(stub, request))) == 3


BAD_REQUESTS = {
    "empty session id": lambda r: r.ClearField("session_id"),
    "10 kB session id": lambda r: setattr(r, "session_id", "s" * 10_240),
    "empty token ids": lambda r: r.ClearField("token_ids"),
    "target_address not host:port": lambda r: setattr(r, "target_address", "no-port"),
    "target_address of no pool member": lambda r: setattr(r, "target_address", "10.255.255.1:1"),
    "two target addresses": lambda r: setattr(r, "target_address", "127.0.0.1:1,127.0.0.1:2"),
    "negative token id": lambda r: r.token_ids.append(-1),
    "token id beyond the vocabulary": lambda r: r.token_ids.append(10_000),
    "prompt_len 0": lambda r: setattr(r, "prompt_len", 0),
    "prompt_len beyond the tokens": lambda r: setattr(r, "prompt_len", 100),
    "negative K": lambda r: setattr(r, "num_speculative_tokens", -1),
    "K above 64": lambda r: setattr(r, "num_speculative_tokens", 65),
    "negative temperature": lambda r: setattr(r.params.sampling, "temperature", -0.5),
    "NaN temperature": lambda r: setattr(r.params.sampling, "temperature", float("nan")),
    "top_p above 1": lambda r: setattr(r.params.sampling, "top_p", 1.5),
    "negative top_k": lambda r: setattr(r.params.sampling, "top_k", -2),
    "min_p above 1": lambda r: setattr(r.params.sampling, "min_p", 1.5),
    "typical_p above 1": lambda r: setattr(r.params.sampling, "typical_p", 1.5),
    "negative session budget": lambda r: setattr(r.params, "max_new_tokens", -3),
    "negative call budget": lambda r: setattr(r, "max_new_tokens", -1),
}


async def test_bad_input_is_invalid_argument_and_the_service_goes_on(ngram_draft, fake_target, metrics):
    good = prefill(fake_target, max_new_tokens=6)
    channel, stub = await connect(ngram_draft)
    async with channel:
        for name, spoil in BAD_REQUESTS.items():
            bad = draft_pb2.SpeculateRequest()
            bad.CopyFrom(good)
            spoil(bad)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await speculate(stub, bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert err.value.details(), name
        assert fake_target.service.requests == []  # nothing reached the target
        assert len(tokens_of(await speculate(stub, good))) == 5
    assert active(metrics) == 0


async def test_a_target_outside_the_pool_is_refused_and_said_so_for_the_gateway(ngram_draft, fake_target):
    """The trailing metadata lets a gateway place the leg on a draft that serves that target."""
    request = prefill(fake_target, max_new_tokens=3)
    request.target_address = "10.255.255.1:1"
    channel, stub = await connect(ngram_draft)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await speculate(stub, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "10.255.255.1:1" in err.value.details()
    trailing = dict(err.value.trailing_metadata() or ())
    assert trailing["tandem-failed-hop"] == "unknown-target" and trailing["tandem-target-address"] == "10.255.255.1:1"
    refusal = translate("draft", "127.0.0.1:9", err.value)
    assert isinstance(refusal, TargetNotServed) and (refusal.draft, refusal.target) == ("127.0.0.1:9", "10.255.255.1:1")
    assert refusal.http_status == 503


async def test_target_errors_reach_the_caller_with_their_code(ngram_draft, fake_target):
    good = prefill(fake_target, max_new_tokens=3)
    unknown = draft_pb2.SpeculateRequest()
    unknown.CopyFrom(good)
    unknown.session_id = "never-prefilled"
    channel, stub = await connect(ngram_draft)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await speculate(stub, unknown)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "never-prefilled" in err.value.details()
        assert len(tokens_of(await speculate(stub, good))) == 2
    assert fake_target.service.released == []  # a failed session is left to the caller


async def test_health_reflection_and_info(hf_draft, fake_target, draft):
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{hf_draft.port}")
    async with channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tandem.v1.DraftService"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = reflection.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        reply = await call.read()
        await call.done_writing()
        names = {service.name for service in reply.list_services_response.service}
        assert "tandem.v1.DraftService" in names and "grpc.health.v1.Health" in names
        info = await draft_pb2_grpc.DraftServiceStub(channel).Info(draft_pb2.DraftServiceInfoRequest())
    assert info.proposer == "hf" and info.model_name == draft.name
    assert info.tokenizer_fingerprint == tokenizer_fingerprint(draft.tokenizer)
    assert info.num_speculative_tokens == 4 and info.target_model_name == fake_target.service.model_name


async def test_start_waits_until_the_target_is_serving(target):
    fake = await start_fake_target(target, serving=False)
    try:
        starting = asyncio.create_task(start_draft(lambda info: NgramProposer(), fake.address, target_wait_s=30))
        await asyncio.sleep(0.6)
        assert not starting.done()
        await fake.health.serving()
        running = await asyncio.wait_for(starting, 10)
        await running.stop(0)
    finally:
        await fake.server.stop(None)


async def test_start_gives_up_on_an_absent_target():
    with pytest.raises(TargetUnavailableError, match="127.0.0.1:9"):
        await start_draft(lambda info: NgramProposer(), "127.0.0.1:9", target_wait_s=0.5)


async def test_start_refuses_a_draft_with_another_tokenizer(target, draft):
    fake = await start_fake_target(target, fingerprint="f" * 32)
    try:
        with pytest.raises(TokenizerMismatchError) as err:
            await start_draft(lambda info: HfProposer(draft), fake.address, target_wait_s=10)
        message = str(err.value)
        assert draft.name in message and target.name in message
        assert "f" * 32 in message and tokenizer_fingerprint(draft.tokenizer) in message
        # The model-free ngram draft has no tokenizer to disagree with.
        running = await start_draft(lambda info: NgramProposer(), fake.address, target_wait_s=10)
        await running.stop(0)
    finally:
        await fake.server.stop(None)


class CountingLookup(NgramProposer):
    """Prompt lookup that counts its sessions and records the committed length each proposal saw."""

    def __init__(self) -> None:
        super().__init__()
        self.sessions = 0
        self.seen: list[int] = []

    def new_session(self, token_ids, sampling, shaping=None):
        self.sessions += 1
        session = super().new_session(token_ids, sampling, shaping)
        propose = session.propose

        def recording(max_tokens):
            self.seen.append(len(session._tokens))
            return propose(max_tokens)

        session.propose = recording
        return session


async def test_a_sessions_next_call_resumes_its_proposer_where_the_last_one_stopped(fake_target, target, metrics):
    proposer = CountingLookup()
    running = await start_draft(lambda info: proposer, fake_target.address, metrics=metrics, target_wait_s=10)
    proposer.sessions, proposer.seen = 0, []  # the warm-up's
    n = 24
    request = prefill(fake_target, max_new_tokens=n)
    committed = list(request.token_ids)
    try:
        channel, stub = await connect(running)
        async with channel:
            for leg in (5, 7, 0):  # legs as the gateway runs them; 0 = to the end
                request.token_ids[:] = committed
                request.max_new_tokens = leg
                committed += tokens_of(await speculate(stub, request))
            # Between two legs, one token committed elsewhere (a Generate step): the parked
            # proposer session no longer matches and a fresh one starts.
            second = prefill(fake_target, session_id="t", max_new_tokens=n)
            second.max_new_tokens = 4
            head = list(second.token_ids) + tokens_of(await speculate(stub, second))
            step = fake_target.service.target.verify("t", len(head), (), ())
            head += step.committed_token_ids
            second.token_ids[:] = head
            second.max_new_tokens = 0
            head += tokens_of(await speculate(stub, second))
    finally:
        await running.stop(0)
    expected = generate_greedy(target.model, PROMPT, n, target.tokenizer.eos_token_id)
    assert committed[len(PROMPT):] == expected and head[len(PROMPT):] == expected
    assert proposer.sessions == 1 + 2  # three legs of "s" share one session; "t" needed two
    # Every proposal saw the whole committed sequence (the base of the block it made; blocks cut
    # to no drafts by the budget are sent without asking the proposer): the last verdict of a
    # leg reached the resumed session before its first proposal.
    bases = iter(r.base_len for r in fake_target.service.requests)
    assert all(any(seen == base for base in bases) for seen in proposer.seen)
