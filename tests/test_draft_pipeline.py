"""The pipelined speculation loop (draft_service.pipeline): blocks sent before the verdicts of the
ones before them. Lossless against the reference target whatever the assumptions (all hold: the
target's own weights; some fail: a nearby model; many fail: another model, prompt lookup), no
committed token left unstreamed when a call's budget ends with blocks in flight, and the engine
over gRPC with the real target."""

from __future__ import annotations

import pytest
from draft_fakes import InMemoryVerifier, generate_greedy
from test_draft_loop import PROMPT, collect, draft, near_target, run_inline, start_session, streamed, target  # noqa: F401

from draft_service.pipeline import PipelinedLoop
from draft_service.proposers.hf import HfProposer
from draft_service.proposers.ngram import NgramProposer
from draft_service.types import FinishReason, SamplingParams, SessionSpec


def make_pipelined(proposer, verifier, committed, depth=2, k=4, **spec_fields) -> PipelinedLoop:
    spec = SessionSpec(session_id="s", token_ids=committed, prompt_len=len(PROMPT), sampling=SamplingParams(),
                       num_speculative_tokens=k, **spec_fields)
    return PipelinedLoop(spec, proposer.new_session(committed, SamplingParams()), verifier, run_inline, depth=depth)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("drafter", ["same-weights", "near-weights", "other-weights", "ngram"])
async def test_pipelined_greedy_output_equals_the_targets_generate(target, draft, near_target, drafter, depth):
    n = 40
    proposer = {"other-weights": lambda: HfProposer(draft), "near-weights": lambda: HfProposer(near_target),
                "same-weights": lambda: HfProposer(target), "ngram": lambda: NgramProposer()}[drafter]()
    reference, committed = start_session(target, max_new_tokens=n)
    verifier = InMemoryVerifier(reference)
    loop = make_pipelined(proposer, verifier, committed, depth=depth, session_max_new_tokens=n)
    results = await collect(loop)
    expected = generate_greedy(target.model, PROMPT, n, target.tokenizer.eos_token_id)
    assert [committed[-1], *streamed(results)] == expected
    assert results[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assumed = [b for b in verifier.blocks if b.assumed_token_ids]
    if drafter == "same-weights":  # every assumption holds: blocks in flight all the way
        assert len(assumed) >= len(verifier.blocks) // 2 and loop.stale_blocks == 0
    if drafter == "near-weights":  # some hold, some fail: both paths taken, nothing lost
        assert assumed and loop.stale_blocks > 0
    committed_len = len(committed)
    for result in results:
        committed_len += len(result.token_ids)
        assert result.committed_len == committed_len


async def test_a_call_that_ends_with_blocks_in_flight_streams_what_they_commit(target, draft, near_target):
    reference, committed = start_session(target, max_new_tokens=40)
    verifier = InMemoryVerifier(reference)
    loop = make_pipelined(HfProposer(near_target), verifier, committed, depth=3, max_new_tokens=7)
    results = await collect(loop)
    assert len(streamed(results)) >= 7 and results[-1].finish_reason is FinishReason.NONE
    # Every token the target committed reached the caller, in order.
    assert [*committed, *streamed(results)] == reference.sessions["s"].tokens
    # And the session resumes from there (a parked proposer session with its assumptions dropped).
    resumed = (*committed, *streamed(results))
    spec = SessionSpec(session_id="s", token_ids=resumed, prompt_len=len(PROMPT), sampling=SamplingParams(),
                       num_speculative_tokens=4, session_max_new_tokens=40)
    session = loop._proposer  # the parked session, as the engine hands it on
    session.commit(*loop.pending_commit)
    rest = await collect(PipelinedLoop(spec, session, verifier, run_inline, depth=3))
    expected = generate_greedy(target.model, PROMPT, 40, target.tokenizer.eos_token_id)
    assert [committed[-1], *streamed(results), *streamed(rest)] == expected


async def test_pipelined_speculation_over_grpc_equals_generate(target):
    """The draft service with --pipeline-depth 2 against the real target service."""
    import grpc
    from test_draft_e2e import PROMPT as E2E_PROMPT
    from test_draft_e2e import prefill

    from draft_service.main import start_draft
    from tandem.v1 import common_pb2, draft_pb2_grpc
    from target_service.engine import TargetEngine
    from target_service.main import start_target

    n = 32
    served = await start_target(TargetEngine(target))
    address = f"127.0.0.1:{served.port}"
    drafting = await start_draft(lambda info: HfProposer(target), address, num_speculative_tokens=4,
                                 target_wait_s=10, pipeline_depth=2)
    try:
        request = await prefill(address, target, "piped", n)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{drafting.port}") as channel:
            replies = [r async for r in draft_pb2_grpc.DraftServiceStub(channel).Speculate(request)]
        assert replies[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        tokens = [request.token_ids[-1], *(t for r in replies for t in r.token_ids)]
        assert tokens == generate_greedy(target.model, E2E_PROMPT, n, target.tokenizer.eos_token_id)
    finally:
        await drafting.stop(0)
        await served.stop(0)
