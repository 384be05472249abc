"""The speculation loop against an in-memory reference target (no sockets, no threads).

The target is ``ReferenceTarget``: target.proto's greedy semantics over a tiny model, so the
streamed tokens can be compared with transformers' own ``generate()`` token for token.
"""

from __future__ import annotations

import dataclasses

import pytest
from draft_fakes import InMemoryVerifier, ReferenceTarget, generate_greedy, greedy_continuation

from draft_service.errors import DivergedError, ProtocolError
from draft_service.loop import MAX_STALE_RETRIES, SpeculationLoop
from draft_service.proposers.hf import HfProposer
from draft_service.proposers.ngram import NgramProposer
from draft_service.types import FinishReason, RoundResult, SamplingParams, SessionSpec, Verdict, VerdictStatus

PROMPT = (2, 40, 41, 42, 43, 44, 45, 46)


async def run_inline(fn, *args):
    """The loop's run_model without a thread: the tests stay deterministic."""
    return fn(*args)


def start_session(target, prompt=PROMPT, **prefill) -> tuple[ReferenceTarget, tuple[int, ...]]:
    """Prefills like the gateway does; returns the target and the committed sequence."""
    reference = ReferenceTarget(target.model, (target.tokenizer.eos_token_id,))
    first, finish = reference.prefill("s", prompt, **prefill)
    assert finish is FinishReason.NONE
    return reference, (*prompt, first)


GREEDY = SamplingParams()


def make_loop(proposer, verifier, committed, k=4, sampling=GREEDY, **spec_fields):
    spec = SessionSpec(
        session_id="s",
        token_ids=committed,
        prompt_len=len(PROMPT),
        sampling=sampling,
        num_speculative_tokens=k,
        **spec_fields,
    )
    session = proposer.new_session(committed, sampling)
    return SpeculationLoop(spec, session, verifier, run_inline)


async def collect(loop: SpeculationLoop) -> list[RoundResult]:
    return [result async for result in loop.rounds()]


def streamed(results: list[RoundResult]) -> list[int]:
    return [token for result in results for token in result.token_ids]


@pytest.mark.parametrize("drafter", ["other-weights", "near-weights", "same-weights", "ngram"])
async def test_greedy_output_equals_the_targets_generate(target, draft, near_target, drafter):
    n = 40
    proposer = {
        "other-weights": lambda: HfProposer(draft),
        "near-weights": lambda: HfProposer(near_target),
        "same-weights": lambda: HfProposer(target),
        "ngram": lambda: NgramProposer(),
    }[drafter]()
    reference, committed = start_session(target, max_new_tokens=n)
    verifier = InMemoryVerifier(reference)
    results = await collect(make_loop(proposer, verifier, committed, session_max_new_tokens=n))

    expected = generate_greedy(target.model, PROMPT, n, target.tokenizer.eos_token_id)
    assert [committed[-1], *streamed(results)] == expected
    assert results[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    committed_len = len(committed)
    for result in results:
        assert len(result.token_ids) == result.num_accepted + 1 or result.finish_reason is not FinishReason.NONE
        committed_len += len(result.token_ids)
        assert result.committed_len == committed_len
    if drafter == "same-weights":  # the target's own weights: every draft token is accepted
        assert all(r.num_accepted == r.num_draft_tokens for r in results)
        assert sum(r.num_draft_tokens for r in results) > n // 2
    if drafter == "near-weights":  # rollback after partial acceptance is exercised
        assert any(0 < r.num_accepted < r.num_draft_tokens for r in results)


async def test_blocks_never_exceed_the_session_budget(target, draft):
    n = 9  # the prefill token + 8: blocks of K=5 must shrink to fit
    reference, committed = start_session(target, max_new_tokens=n)
    verifier = InMemoryVerifier(reference)
    results = await collect(make_loop(HfProposer(target), verifier, committed, k=5, session_max_new_tokens=n))
    assert len(streamed(results)) == n - 1 and results[-1].finish_reason is FinishReason.LENGTH
    for block in verifier.blocks:
        remaining = n - (block.base_len - len(PROMPT))
        assert len(block.proposal.token_ids) <= remaining - 1
    assert [len(b.proposal.token_ids) for b in verifier.blocks][-1] < 5


async def test_stop_token_ends_the_stream_with_it(target, draft):
    continuation = greedy_continuation(target.model, PROMPT, 20)
    # A token first produced a few rounds in (random tiny models repeat themselves a lot).
    stop_at = next(i for i in range(3, len(continuation)) if continuation[i] not in continuation[:i])
    stop_id = continuation[stop_at]
    reference, committed = start_session(target, stop_token_ids=[stop_id])
    results = await collect(make_loop(HfProposer(draft), InMemoryVerifier(reference), committed))
    assert streamed(results) == continuation[1 : stop_at + 1]
    assert results[-1].finish_reason is FinishReason.STOP


async def test_call_budget_stops_after_the_round_that_reaches_it_and_can_resume(target, draft):
    reference, committed = start_session(target, max_new_tokens=30)
    verifier = InMemoryVerifier(reference)
    first = await collect(make_loop(HfProposer(draft), verifier, committed, k=5, max_new_tokens=7))
    before_last = len(streamed(first[:-1]))
    assert before_last < 7 <= len(streamed(first)) <= before_last + 5 + 1  # the last round was not cut
    assert first[-1].finish_reason is FinishReason.NONE  # the session goes on in the target
    assert all(len(b.proposal.token_ids) == 5 for b in verifier.blocks)  # full blocks: a leg is no budget
    resumed = (*committed, *streamed(first))
    rest = await collect(make_loop(HfProposer(draft), verifier, resumed, session_max_new_tokens=30))
    expected = generate_greedy(target.model, PROMPT, 30, target.tokenizer.eos_token_id)
    assert [committed[-1], *streamed(first), *streamed(rest)] == expected


class StaleOnce:
    """Answers chosen blocks STALE (at a committed length shifted by ``offset``) instead of the target."""

    def __init__(self, inner: InMemoryVerifier, stale_blocks: set[int], offset: int = 0) -> None:
        self.inner = inner
        self.stale_blocks = stale_blocks
        self.offset = offset
        self.refused = 0

    async def verify(self, block):
        if block.block_id in self.stale_blocks:
            self.refused += 1
            now = len(self.inner.target.sessions[block.session_id].tokens)
            return Verdict(block.block_id, VerdictStatus.STALE, committed_len=now + self.offset)
        return await self.inner.verify(block)


async def test_a_transient_stale_verdict_is_retried_without_losing_tokens(target, draft):
    n = 20
    reference, committed = start_session(target, max_new_tokens=n)
    verifier = StaleOnce(InMemoryVerifier(reference), stale_blocks={1, 3})
    results = await collect(make_loop(HfProposer(draft), verifier, committed, session_max_new_tokens=n))
    expected = generate_greedy(target.model, PROMPT, n, target.tokenizer.eos_token_id)
    assert verifier.refused == 2
    assert [committed[-1], *streamed(results)] == expected


@pytest.mark.parametrize("offset", [-1, 2])
async def test_diverged_committed_length_stops_the_loop_without_streaming_guesses(target, draft, offset):
    reference, committed = start_session(target)
    verifier = StaleOnce(InMemoryVerifier(reference), stale_blocks={2}, offset=offset)
    loop = make_loop(HfProposer(draft), verifier, committed)
    results = []
    with pytest.raises(DivergedError, match="continue the session with the target's Generate"):
        async for result in loop.rounds():
            results.append(result)
    assert len(results) == 2
    assert [*committed, *streamed(results)] == reference.sessions["s"].tokens


async def test_repeated_stale_verdicts_give_up(target):
    reference, committed = start_session(target)
    verifier = StaleOnce(InMemoryVerifier(reference), stale_blocks=set(range(100)))
    with pytest.raises(DivergedError, match="in a row"):
        await collect(make_loop(NgramProposer(), verifier, committed))
    assert verifier.refused == MAX_STALE_RETRIES + 1 and verifier.inner.blocks == []
    assert reference.sessions["s"].tokens == list(committed)


async def test_a_finished_session_ends_the_stream_with_its_reason(target):
    reference, committed = start_session(target, max_new_tokens=2)
    results = await collect(make_loop(NgramProposer(), InMemoryVerifier(reference), committed))
    assert results[-1].finish_reason is FinishReason.LENGTH and len(streamed(results)) == 1
    # Speculating on the finished session: one closing result, nothing committed.
    closing = await collect(make_loop(NgramProposer(), InMemoryVerifier(reference), (*committed, *streamed(results))))
    assert len(closing) == 1
    assert closing[0].token_ids == () and closing[0].finish_reason is FinishReason.LENGTH
    assert not closing[0].verified


class Tampering:
    """Corrupts verdicts to check the loop refuses contract violations instead of streaming them."""

    def __init__(self, inner: InMemoryVerifier, **changes) -> None:
        self.inner = inner
        self.changes = changes

    async def verify(self, block):
        return dataclasses.replace(await self.inner.verify(block), **self.changes)


@pytest.mark.parametrize(
    "changes",
    [
        {"block_id": 99},
        {"committed_len": 3},
        {"num_accepted": 9},
        {"committed_token_ids": (), "committed_len": len(PROMPT) + 1},
    ],
    ids=["wrong-block", "wrong-length", "too-many-accepted", "no-progress"],
)
async def test_contract_violations_raise_protocol_errors(target, changes):
    reference, committed = start_session(target)
    loop = make_loop(HfProposer(target), Tampering(InMemoryVerifier(reference), **changes), committed)
    with pytest.raises(ProtocolError):
        await collect(loop)
