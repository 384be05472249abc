"""The draft service against the real in-process target service, over gRPC on loopback.

The test plays the gateway: Prefill in the target, then Speculate in the draft. Greedy output must
equal transformers' greedy ``generate()`` of the target, token for token.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import grpc
import pytest
from draft_fakes import generate_greedy, load_tiny

from draft_service.main import start_draft
from draft_service.proposers.hf import HfProposer
from draft_service.proposers.ngram import NgramProposer
from tandem.telemetry.metrics import make_metrics
from tandem.models import tokenizer_fingerprint
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

target_main = pytest.importorskip("target_service.main")
target_engine = pytest.importorskip("target_service.engine")

# Longer than the tiny Gemma's sliding window (8), so target and draft roll back across it.
PROMPT = (2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52)


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return load_tiny(tiny_dir)


@pytest.fixture(scope="module")
def llama_draft(tiny_draft_dir):
    return load_tiny(tiny_draft_dir)


@pytest.fixture(scope="module")
def gemma(tiny_gemma_dir):
    return load_tiny(tiny_gemma_dir)


@asynccontextmanager
async def target_and_draft(target_loaded, proposer_factory, metrics=None):
    """A real target serving ``target_loaded`` and a draft service in front of it."""
    target = await target_main.start_target(target_engine.TargetEngine(target_loaded, metrics=metrics))
    address = f"127.0.0.1:{target.port}"
    try:
        draft = await start_draft(proposer_factory, address, num_speculative_tokens=4, target_wait_s=10)
        try:
            yield address, draft
        finally:
            await draft.stop(0)
    finally:
        await target.stop(0)


async def prefill(target_address, target_loaded, session_id, max_new_tokens, **sampling):
    """The gateway's part: Prefill in the target; returns the draft's Speculate request."""
    fingerprint = tokenizer_fingerprint(target_loaded.tokenizer)
    params = common_pb2.SessionParams(sampling=common_pb2.SamplingParams(**sampling), max_new_tokens=max_new_tokens)
    async with grpc.aio.insecure_channel(target_address) as channel:
        first = await target_pb2_grpc.TargetServiceStub(channel).Prefill(
            target_pb2.PrefillRequest(
                session_id=session_id, prompt_token_ids=PROMPT, params=params, tokenizer_fingerprint=fingerprint
            )
        )
    return draft_pb2.SpeculateRequest(
        session_id=session_id,
        token_ids=[*PROMPT, first.token_id],
        prompt_len=len(PROMPT),
        params=params,
        tokenizer_fingerprint=fingerprint,
    )


async def speculate_session(target_loaded, proposer_factory, max_new_tokens, **sampling):
    """Prefills one session and speculates it to the end; returns all its tokens and the responses."""
    async with target_and_draft(target_loaded, proposer_factory) as (address, draft):
        request = await prefill(address, target_loaded, "e2e", max_new_tokens, **sampling)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{draft.port}") as channel:
            responses = [r async for r in draft_pb2_grpc.DraftServiceStub(channel).Speculate(request)]
    assert responses[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    return [request.token_ids[-1], *(token for r in responses for token in r.token_ids)], responses


@pytest.mark.parametrize("drafter", ["hf", "ngram"])
async def test_greedy_speculation_equals_the_targets_generate(llama, llama_draft, drafter):
    n = 32
    factory = {
        "hf": lambda info: HfProposer(llama_draft, vocab_limit=info.vocab_size),
        "ngram": lambda info: NgramProposer(),
    }[drafter]
    tokens, _ = await speculate_session(llama, factory, n)
    assert tokens == generate_greedy(llama.model, PROMPT, n, llama.tokenizer.eos_token_id)


async def test_greedy_speculation_past_the_sliding_window(gemma):
    """A Gemma 3 target (window 8) with itself as the draft, so every block is fully accepted and
    both KV caches grow past the window."""
    n = 24
    tokens, responses = await speculate_session(gemma, lambda info: HfProposer(gemma, vocab_limit=info.vocab_size), n)
    assert tokens == generate_greedy(gemma.model, PROMPT, n, gemma.tokenizer.eos_token_id)
    assert all(r.num_accepted == r.num_draft_tokens for r in responses[:-1])


async def test_seeded_sampling_round_trips_sparse_q(llama, llama_draft):
    """The real target accepts the draft's sparse q and rejection-samples with it; a seeded session
    is reproducible end to end."""
    factory = lambda info: HfProposer(llama_draft, vocab_limit=info.vocab_size)
    first, responses = await speculate_session(llama, factory, 20, temperature=1.0, seed=42)
    again, _ = await speculate_session(llama, factory, 20, temperature=1.0, seed=42)
    assert len(first) == 20 or responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert first == again
    assert sum(r.num_draft_tokens for r in responses) > 0


async def test_cancelled_speculate_frees_the_session_in_both_services(llama, caplog):
    caplog.set_level(logging.INFO, logger="draft_service.engine")
    metrics = make_metrics("target")
    live = metrics.sessions_active.labels(mode="target")
    async with target_and_draft(llama, lambda info: NgramProposer(), metrics) as (address, draft):
        request = await prefill(address, llama, "gone", max_new_tokens=1500)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{draft.port}") as channel:
            call = draft_pb2_grpc.DraftServiceStub(channel).Speculate(request)
            await call.read()
            assert live._value.get() == 1
            call.cancel()
            for _ in range(250):
                if live._value.get() == 0 and not draft.engine.active_sessions:
                    break
                await asyncio.sleep(0.02)
        assert live._value.get() == 0, "the target still holds the cancelled session's KV cache"
        assert draft.engine.active_sessions == []
    assert "released abandoned session 'gone'" in caplog.text  # freed by Release, not by finishing


async def test_blocks_sent_before_the_verdicts_are_verified_in_order_against_what_was_committed(llama):
    """The Verify stream's pipelined form (issue 28): block 1 goes out before verdict 0, assuming
    block 0 accepted whole with its bonus token; block 2 assumes what block 1 made stale."""
    from draft_service.target_client import TargetClient
    from draft_service.types import Proposal, ProposedBlock, VerdictStatus

    n_new = 16
    reference = generate_greedy(llama.model, PROMPT, n_new, llama.tokenizer.eos_token_id)
    target = await target_main.start_target(target_engine.TargetEngine(llama))
    address = f"127.0.0.1:{target.port}"
    client = TargetClient(address)
    try:
        await prefill(address, llama, "pipe", n_new)
        n = len(PROMPT) + 1
        stream = client.open_verify_stream("pipe")

        def block(block_id, base_len, drafts, assumed=()):
            return ProposedBlock("pipe", block_id, base_len, Proposal(tuple(drafts)), assumed_token_ids=tuple(assumed))

        sent = [block(0, n, reference[1:3]),
                block(1, n, reference[4:6], assumed=reference[1:4]),  # block 0 whole + its bonus token
                block(2, n, [1], assumed=reference[1:4])]  # stale once block 1 committed
        for b in sent:
            await stream.send(b)
        verdicts = [await stream.receive(b.block_id) for b in sent]
        assert [v.status for v in verdicts] == [VerdictStatus.OK, VerdictStatus.OK, VerdictStatus.STALE]
        assert [v.block_id for v in verdicts] == [0, 1, 2]
        committed = [reference[0], *verdicts[0].committed_token_ids, *verdicts[1].committed_token_ids]
        assert committed == reference[:7] and verdicts[2].committed_len == n + 6
        after = await stream.verify(block(3, n + 6, reference[7:9]))
        assert after.status is VerdictStatus.OK and list(after.committed_token_ids) == reference[7:10]
        await stream.close()
    finally:
        await client.close()
        await target.stop(0)
