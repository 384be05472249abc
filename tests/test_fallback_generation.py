"""gateway.generation with in-memory upstreams: mid-session fallback, re-probing, draft crashes that
lose a verdict, stalls, the breaker, and smoothing that changes nothing but timing."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from gateway.adaptive import AdaptiveConfig
from gateway.breaker import BreakerConfig, BreakerState, DraftBreaker
from gateway.errors import UpstreamUnavailable
from gateway.events import Finished, TextDelta
from gateway.deps import GenerationDeps, SessionTuning
from gateway.generation import Generation
from gateway.policy import SpeculationPolicy
from gateway.pool import Pool
from gateway.request import GenerationRequest, SamplingParams, Smoothing, Speculation
from gateway.served_model import ServedModel
from gateway_fakes import (
    SCRIPT_TEXT,
    InMemoryDraft,
    InMemoryStream,
    InMemoryTarget,
    ScriptedModel,
)
from tandem.telemetry.metrics import make_metrics
from tandem.v1 import draft_pb2

K = 4
ADAPTIVE = AdaptiveConfig(window_rounds=4, warmup_rounds=4, min_segment_tokens=4, reprobe_after_tokens=8,
                          probe_tokens=6)


@pytest.fixture
def model(tokenizer):
    return ScriptedModel(tokenizer)


def make_deps(tokenizer, model, draft, *, smoothing=Smoothing.OFF, stall_s=5.0, adaptive=ADAPTIVE):
    return GenerationDeps(
        targets=Pool.of("target", {"target": InMemoryTarget(model)}),
        drafts=Pool.of("draft", {"draft": draft}, breaker=lambda: DraftBreaker(BreakerConfig(cooldown_s=0.0))),
        model=ServedModel("tiny", tokenizer, 128),
        policy=SpeculationPolicy(),
        metrics=make_metrics("gateway"),
        draft_ready=lambda: True,
        default_num_speculative_tokens=K,
        tuning=SessionTuning(smoothing=smoothing, adaptive=adaptive, draft_stall_timeout_s=stall_s),
    )


def breaker_of(deps):
    """The breaker of the fixture's one draft."""
    return deps.drafts.members["draft"].breaker


def make_request(tokenizer, speculation=Speculation.AUTO, stop=(), smoothing=None, max_tokens=100):
    return GenerationRequest(
        prompt_token_ids=tuple(tokenizer("Once upon", add_special_tokens=False)["input_ids"]),
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None),
        stop=tuple(stop),
        stop_token_ids=(),
        ignore_eos=False,
        speculation=speculation,
        num_speculative_tokens=None,
        stream_smoothing=smoothing,
    )


async def run(deps, request):
    generation = Generation(request, deps)
    async with generation:
        await generation.start()
        events = [event async for event in generation.events()]
    deltas = [e for e in events if isinstance(e, TextDelta)]
    (finished,) = [e for e in events if isinstance(e, Finished)]
    assert events[-1] is finished
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], finished, deltas


def sample(deps, name, **labels):
    return deps.metrics.registry.get_sample_value(name, labels) or 0.0


class ScriptedDraft(InMemoryDraft):
    """Commits one token per round with ``accepted`` of K accepted; ``lose_after`` rounds in, it
    commits a round in the target and dies before forwarding it (the verdict is lost)."""

    def __init__(self, model, accepted=0, lose_after=None, stall_after=None, pause=None, drafted=K, positions=0):
        super().__init__(model)
        self.accepted = accepted
        self.drafted, self.positions = drafted, positions  # positions < drafted: a token tree
        self.lose_after = lose_after
        self.stall_after = stall_after
        self.pause = pause  # (after this many tokens, seconds): one silence, as behind a busy target
        self.requests: list[draft_pb2.SpeculateRequest] = []

    def speculate(self, request):
        self.requests.append(request)
        self.streams.append(InMemoryStream(self._script(request)))
        return self.streams[-1]

    async def _script(self, request):
        sent = 0
        while not request.max_new_tokens or sent < request.max_new_tokens:
            await asyncio.sleep(0)
            if self.stall_after is not None and len(self.model.sessions) and sent >= self.stall_after:
                await asyncio.Event().wait()
            if self.pause is not None and sent >= self.pause[0]:
                await asyncio.sleep(self.pause[1])
                self.pause = None
            tokens, session = self.model.commit(request.session_id, 1 + self.accepted)
            if self.lose_after is not None and sent >= self.lose_after:
                raise UpstreamUnavailable("the draft service (in memory) died")
            sent += len(tokens)
            yield draft_pb2.SpeculateResponse(token_ids=tokens, committed_len=session.committed_len,
                                              finish_reason=session.finish, num_draft_tokens=self.drafted,
                                              num_accepted=min(self.accepted, len(tokens)),
                                              num_draft_positions=self.positions)
            if session.finish:
                return


async def test_low_acceptance_falls_back_mid_session_and_reprobes_without_losing_tokens(tokenizer, model):
    draft = ScriptedDraft(model, accepted=0)
    deps = make_deps(tokenizer, model, draft)
    text, tokens, finished, _ = await run(deps, make_request(tokenizer))
    assert text == SCRIPT_TEXT and tokens == model.expected_tokens(1000)
    stats = finished.usage.speculative_decoding
    assert stats.mode == "mixed" and stats.fallbacks >= 2  # the first switch, then a failed probe
    assert sample(deps, "tandem_session_fallbacks_total", reason="low_acceptance") == stats.fallbacks
    # Every Speculate was bounded (the only safe places to switch), the first by the warm-up
    # window, later ones are probes; every one resumed exactly where the client was.
    assert [r.max_new_tokens for r in draft.requests][:2] == [4, 6]
    assert all(r.max_new_tokens > 0 for r in draft.requests)
    assert ("Generate", generation_session(model)) in model.rpcs


def generation_session(model):
    return next(session for name, session in model.rpcs if name == "Prefill")


async def test_good_acceptance_keeps_speculating(tokenizer, model):
    draft = ScriptedDraft(model, accepted=K)
    deps = make_deps(tokenizer, model, draft)
    text, tokens, finished, _ = await run(deps, make_request(tokenizer))
    assert text == SCRIPT_TEXT
    stats = finished.usage.speculative_decoding
    assert (stats.mode, stats.fallbacks, stats.acceptance_rate) == ("speculative", 0, 1.0)


@pytest.mark.parametrize(("positions", "mode"), [(3, "speculative"), (0, "mixed")])
async def test_token_trees_are_judged_on_their_depth_not_their_node_count(tokenizer, model, positions, mode):
    # 24-node trees over 3 positions with one draft accepted a round: 1/3 of what they could
    # have done clears the 0.05 floor, 1/24 per node would not (0: a draft that does not say).
    draft = ScriptedDraft(model, accepted=1, drafted=24, positions=positions)
    deps = make_deps(tokenizer, model, draft)
    text, _, finished, _ = await run(deps, make_request(tokenizer))
    assert text == SCRIPT_TEXT
    stats = finished.usage.speculative_decoding
    assert stats.mode == mode and (stats.fallbacks == 0) == (mode == "speculative")
    assert stats.draft_tokens >= 24 * 4  # usage counts every node drafted


async def test_a_lost_verdict_is_recovered_by_a_fresh_session_without_gaps(tokenizer, model):
    draft = ScriptedDraft(model, accepted=1, lose_after=4)
    deps = make_deps(tokenizer, model, draft)
    text, tokens, finished, _ = await run(deps, make_request(tokenizer))
    assert text == SCRIPT_TEXT and tokens == model.expected_tokens(1000)
    stats = finished.usage.speculative_decoding
    assert (stats.mode, stats.fallbacks) == ("mixed", 1)
    prefills = [session for name, session in model.rpcs if name == "Prefill"]
    assert len(prefills) == 2  # the resync
    assert set(model.released) == set(prefills) and not model.sessions
    assert breaker_of(deps).state is BreakerState.OPEN


async def test_a_stalled_draft_is_abandoned_after_the_deadline(tokenizer, model):
    draft = ScriptedDraft(model, accepted=1, stall_after=4)
    deps = make_deps(tokenizer, model, draft, stall_s=0.05)
    text, tokens, finished, _ = await run(deps, make_request(tokenizer))
    assert text == SCRIPT_TEXT and tokens == model.expected_tokens(1000)
    assert finished.usage.speculative_decoding.fallbacks == 1
    assert draft.streams[-1].cancelled  # the stalled call was abandoned
    assert sample(deps, "tandem_session_fallbacks_total", reason="draft_unavailable") == 1


async def _keep_draft_busy(deps):
    """Stands for other sessions whose rounds the draft keeps delivering."""
    while True:
        deps.counters.draft_answered(time.monotonic())
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("busy", ["other sessions' rounds", "a prefill in flight"])
async def test_a_draft_waiting_behind_a_busy_target_is_not_a_stalled_draft(tokenizer, model, busy):
    """A silence four times the deadline, while the draft serves other sessions or the target runs
    a prefill, keeps the session speculating: no fallback, the breaker stays closed."""
    draft = ScriptedDraft(model, accepted=K, pause=(4, 0.2))
    deps = make_deps(tokenizer, model, draft, stall_s=0.05)
    helper = asyncio.ensure_future(_keep_draft_busy(deps)) if busy == "other sessions' rounds" else None
    if helper is None:
        deps.counters.prefill_started()
    try:
        text, tokens, finished, _ = await run(deps, make_request(tokenizer))
    finally:
        if helper is not None:
            helper.cancel()
    assert text == SCRIPT_TEXT and tokens == model.expected_tokens(1000)
    assert sample(deps, "tandem_session_fallbacks_total", reason="draft_unavailable") == 0
    assert breaker_of(deps).state is BreakerState.CLOSED


@pytest.mark.parametrize(("pause_s", "stalled"), [(0.2, False), (1.0, True)], ids=["slow start", "dead at start"])
async def test_a_calls_first_round_may_take_up_to_the_cap(tokenizer, model, pause_s, stalled):
    """Before its first round a draft takes the session on (its own prefill of the prompt, slower
    the longer the prompt and the busier the machine): that silence is a stall only past the cap
    (12 x the deadline), the way a busy target's is."""
    draft = ScriptedDraft(model, accepted=K, pause=(0, pause_s))
    deps = make_deps(tokenizer, model, draft, stall_s=0.05)  # cap: 0.6 s
    text, tokens, finished, _ = await run(deps, make_request(tokenizer))
    assert text == SCRIPT_TEXT and tokens == model.expected_tokens(1000)
    assert sample(deps, "tandem_session_fallbacks_total", reason="draft_unavailable") == int(stalled)
    assert (breaker_of(deps).state is BreakerState.CLOSED) is not stalled


def test_silence_is_explained_by_recent_rounds_or_prefills_only(tokenizer, model) -> None:
    deps = make_deps(tokenizer, model, ScriptedDraft(model), stall_s=5.0)
    assert not deps.draft_silence_explained(100.0)
    deps.counters.draft_answered(96.0)
    assert deps.draft_silence_explained(100.0) and not deps.draft_silence_explained(101.0)
    deps.counters.prefill_started()
    assert deps.draft_silence_explained(1000.0)
    deps.counters.prefill_finished(998.0)  # the rounds queued behind it come next
    assert deps.draft_silence_explained(1000.0) and not deps.draft_silence_explained(1003.0)


async def test_the_same_silence_with_nothing_else_going_on_is_a_stall(tokenizer, model):
    draft = ScriptedDraft(model, accepted=K, pause=(4, 0.2))
    deps = make_deps(tokenizer, model, draft, stall_s=0.05)
    _, tokens, _, _ = await run(deps, make_request(tokenizer))
    assert tokens == model.expected_tokens(1000)
    assert sample(deps, "tandem_session_fallbacks_total", reason="draft_unavailable") == 1
    assert breaker_of(deps).state is BreakerState.OPEN


async def test_a_draft_stalled_for_one_session_is_abandoned_at_the_cap_however_busy(tokenizer, model):
    draft = ScriptedDraft(model, accepted=1, stall_after=4)
    deps = make_deps(tokenizer, model, draft, stall_s=0.02)  # cap: 12 x 0.02 s
    helper = asyncio.ensure_future(_keep_draft_busy(deps))
    try:
        started = time.monotonic()
        _, tokens, finished, _ = await run(deps, make_request(tokenizer))
    finally:
        helper.cancel()
    assert tokens == model.expected_tokens(1000)
    assert finished.usage.speculative_decoding.fallbacks == 1 and draft.streams[-1].cancelled
    assert time.monotonic() - started >= 12 * 0.02


async def test_the_open_breaker_starts_new_sessions_in_fallback_until_the_draft_recovers(tokenizer, model):
    draft = ScriptedDraft(model, accepted=K, lose_after=0)
    # Without the timing rules: the in-memory target's Generate steps take microseconds, so on a
    # busy machine the recovered session's rounds could look slower and switch it over ("mixed").
    deps = make_deps(tokenizer, model, draft, adaptive=dataclasses.replace(ADAPTIVE, enabled=False))
    await run(deps, make_request(tokenizer))
    assert breaker_of(deps).state is BreakerState.OPEN
    requests_before = len(draft.requests)
    _, _, finished, _ = await run(deps, make_request(tokenizer))
    assert finished.usage.speculative_decoding.mode == "autoregressive"
    assert len(draft.requests) == requests_before  # the draft was not even tried
    draft.lose_after = None
    breaker_of(deps).probe(True)  # the monitor's health probe sees it serving again
    text, _, finished, _ = await run(deps, make_request(tokenizer))
    assert text == SCRIPT_TEXT and finished.usage.speculative_decoding.mode == "speculative"
    assert breaker_of(deps).state is BreakerState.CLOSED


async def test_speculation_on_never_switches(tokenizer, model):
    draft = ScriptedDraft(model, accepted=0)
    deps = make_deps(tokenizer, model, draft)
    _, _, finished, _ = await run(deps, make_request(tokenizer, Speculation.ON))
    assert (finished.usage.speculative_decoding.mode, finished.usage.speculative_decoding.fallbacks) == (
        "speculative", 0)
    assert [r.max_new_tokens for r in draft.requests] == [0]


@pytest.mark.parametrize("stop", [(), ("日本",)])
async def test_smoothing_changes_nothing_but_timing(tokenizer, stop):
    outputs = []
    for smoothing in (Smoothing.OFF, Smoothing.AUTO):
        model = ScriptedModel(tokenizer)
        deps = make_deps(tokenizer, model, ScriptedDraft(model, accepted=2))
        text, tokens, finished, deltas = await run(deps, make_request(tokenizer, stop=stop, smoothing=smoothing))
        outputs.append((text, tokens, finished.finish_reason, finished.usage))
        if smoothing is Smoothing.AUTO:
            assert all(len(d.token_ids) <= 1 for d in deltas)  # paced one token at a time
        else:
            assert any(len(d.token_ids) > 1 for d in deltas)  # raw rounds of 3
    assert outputs[0] == outputs[1]
