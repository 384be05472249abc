"""Proposer sessions parked between a session's Speculate calls: kept, resumed, and let go."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from draft_fakes import InMemoryVerifier, ReferenceTarget, load_tiny

from draft_service.block_length import BlockLengthPolicy
from draft_service.engine import DraftEngine
from draft_service.proposers.ngram import NgramProposer
from draft_service.types import FinishReason, SamplingParams, SessionSpec, TargetInfo
from tandem.models.worker import ModelWorker
from tandem.telemetry.metrics import make_metrics

PROMPT = (2, 40, 41, 42, 43, 44, 45, 46)


class Stream:
    """One Verify stream over the shared in-memory verifier."""

    def __init__(self, verifier: InMemoryVerifier) -> None:
        self.verify = verifier.verify

    async def close(self) -> None:
        pass

    def cancel(self) -> None:
        pass


class Port:
    """The engine's TargetPort over an in-memory reference target, and a pool of that one target
    (under any address)."""

    def __init__(self, target: ReferenceTarget) -> None:
        self.verifier = InMemoryVerifier(target)
        self.released: list[str] = []

    def address_of(self, address: str) -> str:
        return address or "first:1"

    async def client(self, address: str) -> Port:
        return self

    def open_verify_stream(self, session_id: str) -> Stream:
        return Stream(self.verifier)

    async def release(self, session_id: str) -> bool:
        self.released.append(session_id)
        return True


class Counting(NgramProposer):
    def __init__(self) -> None:
        super().__init__()
        self.opened = 0
        self.closed = 0

    def new_session(self, token_ids, sampling, shaping=None):
        self.opened += 1
        session = super().new_session(token_ids, sampling, shaping)
        close = session.close

        def closing() -> None:
            self.closed += 1
            close()

        session.close = closing
        return session


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_tiny(tiny_dir)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup(target):
    reference = ReferenceTarget(target.model)
    proposer = Counting()
    worker = ModelWorker("test-draft")
    clock = Clock()
    info = TargetInfo("tiny", int(target.model.config.vocab_size), "")
    engine = DraftEngine(
        proposer, Port(reference), info, worker, make_metrics("draft"), default_k=3, park_ttl_s=10.0, max_parked=2,
        clock=clock,
    )
    return reference, proposer, engine, worker, clock


async def leg(
    engine: DraftEngine,
    reference: ReferenceTarget,
    session_id: str,
    n: int,
    sampling: SamplingParams | None = None,
    target: str = "",
):
    sampling = sampling if sampling is not None else SamplingParams()
    tokens = tuple(reference.sessions[session_id].tokens)
    spec = SessionSpec(session_id, tokens, len(PROMPT), sampling, 3, max_new_tokens=n, target_address=target)
    async with aclosing(engine.speculate(spec)) as rounds:
        return [t async for r in rounds for t in r.token_ids]


async def drained(worker: ModelWorker) -> None:
    await worker.run(lambda: None)  # closes are submitted to the model thread: let them run


async def test_parked_sessions_expire_are_bounded_and_never_resume_on_other_tokens(setup) -> None:
    reference, proposer, engine, worker, clock = setup
    for session_id in ("a", "b", "c"):
        reference.prefill(session_id, PROMPT, max_new_tokens=40)
        await leg(engine, reference, session_id, 4)
    await drained(worker)
    # Three parked, two kept: the oldest ("a") was closed.
    assert (proposer.opened, proposer.closed) == (3, 1)
    await leg(engine, reference, "b", 4)  # resumed
    assert proposer.opened == 3
    # A different sampling configuration does not resume "c"'s greedy session.
    await leg(engine, reference, "c", 4, SamplingParams(temperature=1.0, seed=1))
    await drained(worker)
    assert (proposer.opened, proposer.closed) == (4, 2)
    # Past the TTL, a parked session is closed and the next call starts afresh.
    clock.now = 11.0
    await leg(engine, reference, "b", 4)
    await drained(worker)
    assert (proposer.opened, proposer.closed) == (5, 4)  # "b"'s and "c"'s expired
    # A finished session is not parked.
    await leg(engine, reference, "b", 0)
    await drained(worker)
    assert reference.sessions["b"].finish is not FinishReason.NONE
    await engine.aclose()
    await drained(worker)
    assert proposer.closed == proposer.opened


async def test_a_call_closed_after_the_finishing_round_releases_nothing(setup) -> None:
    """A caller may stop listening as soon as it reads the verdict that finished the session (the
    target has freed it already): that is no abandoned session. Closed earlier, it is one."""
    reference, _, engine, worker, _ = setup
    port = engine._targets
    for session_id, stop_at_finish in (("done", True), ("left", False)):
        reference.prefill(session_id, PROMPT, max_new_tokens=6)
        spec = SessionSpec(session_id, tuple(reference.sessions[session_id].tokens), len(PROMPT), SamplingParams(), 3)
        async with aclosing(engine.speculate(spec)) as rounds:
            async for result in rounds:
                if not stop_at_finish or result.finish_reason is not FinishReason.NONE:
                    break  # closes the call at this round
        await asyncio.gather(*engine._cleanups)
    assert port.released == ["left"]
    await engine.aclose()
    await drained(worker)


async def test_a_sessions_acceptance_record_outlives_its_calls(target) -> None:
    """The block-length policy weighs the session's own record: a leg after another (or after a
    fallback to the target's Generate) goes on with it rather than with an empty one."""
    reference = ReferenceTarget(target.model)
    worker = ModelWorker("test-draft")
    info = TargetInfo("tiny", int(target.model.config.vocab_size), "")
    engine = DraftEngine(
        NgramProposer(), Port(reference), info, worker, make_metrics("draft"), default_k=3,
        block_lengths=BlockLengthPolicy(),
    )
    reference.prefill("s", (*PROMPT, *PROMPT), max_new_tokens=40)  # the prompt recurs: lookup drafts
    await leg(engine, reference, "s", 6)
    record = engine._parked["s"].acceptance
    offered = record.offered
    assert offered > 0
    await leg(engine, reference, "s", 6)  # resumed
    assert engine._parked["s"].acceptance is record and record.offered > offered
    await engine.aclose()
    worker.shutdown()


async def test_a_session_that_moved_to_another_target_starts_afresh(setup) -> None:
    """Parked state stands for the session on the target it was parked from: on another one (its
    first target died and the gateway moved it) nothing parked is reused."""
    reference, proposer, engine, worker, _ = setup
    reference.prefill("s", PROMPT, max_new_tokens=40)
    await leg(engine, reference, "s", 4)  # "" = the pool's first target, "first:1"
    await leg(engine, reference, "s", 4, target="first:1")  # the same target, named: resumed
    assert (proposer.opened, proposer.closed) == (1, 0)
    await leg(engine, reference, "s", 4, target="second:2")
    await drained(worker)
    assert (proposer.opened, proposer.closed) == (2, 1)
    assert engine._parked["s"].target_address == "second:2"
    await engine.aclose()
    await drained(worker)
