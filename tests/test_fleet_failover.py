"""Failover with in-memory pools (no sockets): a target that dies, hangs or loses the session moves
its session to another target, a draft that dies hands the session to another draft, and the
client's tokens are exactly those of a run without the fault."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gateway.breaker import BreakerConfig, BreakerState, DraftBreaker
from gateway.deps import GenerationDeps, SessionTuning
from gateway.errors import TargetLost, UpstreamFailure, UpstreamUnavailable
from gateway.events import Finished, TextDelta
from gateway.generation import Generation
from gateway.policy import SpeculationPolicy
from gateway.pool import Pool
from gateway.request import GenerationRequest, SamplingParams, Speculation
from gateway.served_model import ServedModel
from gateway_fakes import InMemoryDraft, InMemoryStream, InMemoryTarget, ScriptedModel
from tandem.telemetry.metrics import make_metrics
from tandem.rpc.types import Grammar, GrammarKind
from tandem.v1 import common_pb2, draft_pb2

K = 4
N = 40


class FlakyTarget(InMemoryTarget):
    """Dies (``how="dies"``: the stream raises as a lost connection) or hangs (``how="hangs"``: the
    stream goes silent and health checks fail) after ``after`` Generate tokens of its first stream."""

    def __init__(self, model: ScriptedModel, address: str, after: int, how: str = "dies") -> None:
        super().__init__(model)
        self.address, self.after, self.how = address, after, how

    def generate(self, request):
        source = self.model.generate_stream(request.session_id, request.max_new_tokens)
        return InMemoryStream(self._faulty(source) if self.after >= 0 else source)

    async def _faulty(self, source):
        sent = 0
        async for message in source:
            if sent >= self.after:
                self.after, self.serving = -1, False
                if self.how == "hangs":
                    await asyncio.Event().wait()
                raise TargetLost(f"the target service at {self.address} is unavailable: Socket closed",
                                 reason="unavailable", address=self.address)
            sent += len(message.token_ids)
            yield message


class RoutingDraft(InMemoryDraft):
    """A draft of a two-target pool: it commits on the model of the target the call names, and
    reports that target lost (as a draft's trailing metadata does) when it stops serving."""

    def __init__(self, targets: dict[str, InMemoryTarget], fail_after_rounds: int | None = None) -> None:
        super().__init__(next(iter(targets.values())).model, fail_after_rounds)
        self.targets = targets

    def speculate(self, request: draft_pb2.SpeculateRequest):
        target = self.targets[request.target_address]
        self.model = target.model
        stream = InMemoryStream(self._checked(target, request))
        self.streams.append(stream)
        return stream

    async def _checked(self, target, request):
        async for message in self._rounds(request):
            if not target.serving:
                raise TargetLost(f"the target service at {request.target_address} failed under the draft",
                                 reason="unavailable", address=request.target_address)
            yield message


def make_deps(tokenizer, targets: dict, drafts: dict, **tuning) -> GenerationDeps:
    return GenerationDeps(
        targets=Pool.of("target", targets),
        drafts=Pool.of("draft", drafts, breaker=lambda: DraftBreaker(BreakerConfig(cooldown_s=60.0))),
        model=ServedModel("tiny", tokenizer, 128),
        policy=SpeculationPolicy(),
        metrics=make_metrics("gateway"),
        draft_ready=lambda: True,
        default_num_speculative_tokens=K,
        tuning=SessionTuning(**{"target_timeout_s": 0.05, "failover_wait_s": 2.0, **tuning}),
    )


def make_request(tokenizer, speculation: Speculation) -> GenerationRequest:
    return GenerationRequest(
        prompt_token_ids=tuple(tokenizer("Once upon", add_special_tokens=False)["input_ids"]),
        max_tokens=N,
        sampling=SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None),
        stop=(), stop_token_ids=(), ignore_eos=True, speculation=speculation, num_speculative_tokens=None,
    )


async def run(deps: GenerationDeps, request: GenerationRequest) -> tuple[list[int], Finished]:
    generation = Generation(request, deps)
    async with generation:
        await generation.start()
        events = [event async for event in generation.events()]
    tokens = [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]
    return tokens, events[-1]


def failovers(deps: GenerationDeps, reason: str) -> float:
    return deps.metrics.registry.get_sample_value("tandem_session_failovers_total", {"reason": reason}) or 0.0


@pytest.mark.parametrize("how,reason", [("dies", "unavailable"), ("hangs", "timeout")])
async def test_a_session_moves_to_another_target_and_its_tokens_do_not_change(tokenizer, how, reason):
    a, b = ScriptedModel(tokenizer), ScriptedModel(tokenizer)
    flaky, healthy = FlakyTarget(a, "a:1", after=7, how=how), InMemoryTarget(b)
    deps = make_deps(tokenizer, {"a:1": flaky, "b:1": healthy}, {"d:1": InMemoryDraft(a)})
    deps.targets.members["b:1"].sessions = 1  # placement picks a:1 first
    tokens, finished = await run(deps, make_request(tokenizer, Speculation.OFF))
    assert tokens == a.expected_tokens(N, ignore_eos=True)
    assert finished.finish_reason == "length" and failovers(deps, reason) == 1
    lost = deps.targets.members["a:1"]
    assert not lost.usable and len(lost.owed_releases) == 1  # released once the target is back
    # The new target was prefilled with the prompt and exactly the 8 tokens the client had.
    (prefill,) = [sid for rpc, sid in b.rpcs if rpc == "Prefill"]
    assert b.released == [prefill] and not b.sessions
    assert lost.sessions == 0 and deps.targets.members["b:1"].sessions == 1  # only the preset one
    assert deps.counters.active_sessions == 0


async def test_a_moved_constrained_session_tells_the_new_target_how_much_of_its_text_the_grammar_matched(tokenizer):
    """Structured output: the new target is prefilled with the prompt and the tokens the client has,
    and its grammar goes on after those tokens (not from the start of the text)."""
    a, b = ScriptedModel(tokenizer), ScriptedModel(tokenizer)
    targets = {"a:1": FlakyTarget(a, "a:1", after=3), "b:1": InMemoryTarget(b)}
    deps = make_deps(tokenizer, targets, {"d:1": InMemoryDraft(a)})
    deps.targets.members["b:1"].sessions = 1  # placement picks a:1 first
    grammar = Grammar(GrammarKind.REGEX, ".*")
    request = dataclasses.replace(make_request(tokenizer, Speculation.OFF), ignore_eos=False, grammar=grammar)
    tokens, _ = await run(deps, request)
    assert tokens == a.expected_tokens(N, ignore_eos=False) and failovers(deps, "unavailable") == 1
    (first,), (moved,) = a.prefilled, b.prefilled
    assert (first.grammar.kind, first.grammar.spec, first.continued_tokens) == (common_pb2.GRAMMAR_KIND_REGEX, ".*", 0)
    assert moved.grammar.spec == ".*" and moved.continued_tokens == 4  # the first token and 3 more


async def test_a_target_lost_under_the_draft_moves_the_session_and_keeps_it_speculating(tokenizer):
    a, b = ScriptedModel(tokenizer), ScriptedModel(tokenizer)
    targets = {"a:1": InMemoryTarget(a), "b:1": InMemoryTarget(b)}
    draft = RoutingDraft(targets)
    deps = make_deps(tokenizer, targets, {"d:1": draft})
    deps.targets.members["b:1"].sessions = 1

    async def kill_a_soon():
        while len(a.speculate_requests) == 0 or not any(s.generated[3:] for s in a.sessions.values()):
            await asyncio.sleep(0)
        targets["a:1"].serving = False

    killer = asyncio.ensure_future(kill_a_soon())
    tokens, finished = await run(deps, make_request(tokenizer, Speculation.ON))
    await killer
    assert tokens == a.expected_tokens(N, ignore_eos=True) and failovers(deps, "unavailable") == 1
    assert finished.usage.speculative_decoding.mode == "speculative" and finished.usage.speculative_decoding.fallbacks == 0
    assert {r.target_address for r in b.speculate_requests} == {"b:1"}
    assert deps.drafts.members["d:1"].breaker.state is BreakerState.CLOSED  # the draft is not blamed


async def test_a_dead_draft_hands_its_session_to_another_draft(tokenizer):
    model = ScriptedModel(tokenizer)
    dying, spare = InMemoryDraft(model, fail_after_rounds=2), InMemoryDraft(model)
    deps = make_deps(tokenizer, {"t:1": InMemoryTarget(model)}, {"d0:1": dying, "d1:1": spare})
    deps.drafts.members["d1:1"].sessions = 1  # the first leg goes to d0
    tokens, finished = await run(deps, make_request(tokenizer, Speculation.AUTO))
    assert tokens == model.expected_tokens(N, ignore_eos=True)
    assert finished.usage.speculative_decoding.mode == "speculative" and finished.usage.speculative_decoding.fallbacks == 0
    assert deps.drafts.members["d0:1"].breaker.state is BreakerState.OPEN and spare.streams
    assert not model.sessions  # the resynced session and the abandoned one are both released


async def test_a_session_waits_for_its_only_target_to_restart(tokenizer):
    model = ScriptedModel(tokenizer)
    flaky = FlakyTarget(model, "t:1", after=5)
    deps = make_deps(tokenizer, {"t:1": flaky}, {"d:1": InMemoryDraft(model)})
    member = deps.targets.members["t:1"]

    async def restart():  # what the monitor does once the restarted target answers SERVING
        while member.usable:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        model.sessions.clear()  # a restarted process knows no session
        flaky.serving = member.serving = True

    restarting = asyncio.ensure_future(restart())
    tokens, _ = await run(deps, make_request(tokenizer, Speculation.OFF))
    await restarting
    assert tokens == model.expected_tokens(N, ignore_eos=True) and failovers(deps, "unavailable") == 1


async def test_with_no_target_left_the_client_gets_an_error_naming_it(tokenizer):
    model = ScriptedModel(tokenizer)
    deps = make_deps(tokenizer, {"t:1": FlakyTarget(model, "t:1", after=3)}, {"d:1": InMemoryDraft(model)},
                     failover_wait_s=0.2)
    with pytest.raises(UpstreamUnavailable) as info:
        await run(deps, make_request(tokenizer, Speculation.OFF))
    assert "t:1" in info.value.message and "no target served within 0.2s" in info.value.message
    assert deps.counters.active_sessions == 0 and deps.targets.members["t:1"].sessions == 0


async def test_a_draft_failing_because_its_target_died_moves_the_session_not_the_blame(tokenizer):
    """A draft may report its target's death as its own failure (no tag): the gateway asks the
    target's health before blaming the draft, and moves the session when the target is gone."""
    a, b = ScriptedModel(tokenizer), ScriptedModel(tokenizer)
    targets = {"a:1": InMemoryTarget(a), "b:1": InMemoryTarget(b)}

    class UntaggedDraft(RoutingDraft):
        async def _checked(self, target, request):
            async for message in self._rounds(request):
                if not target.serving:
                    raise UpstreamFailure("the draft service failed (INTERNAL): RPC already finished.")
                yield message

    deps = make_deps(tokenizer, targets, {"d:1": UntaggedDraft(targets)})
    deps.targets.members["b:1"].sessions = 1

    async def kill_a_soon():
        while not any(s.generated[3:] for s in a.sessions.values()):
            await asyncio.sleep(0)
        targets["a:1"].serving = False

    killer = asyncio.ensure_future(kill_a_soon())
    tokens, finished = await run(deps, make_request(tokenizer, Speculation.ON))
    await killer
    assert tokens == a.expected_tokens(N, ignore_eos=True) and failovers(deps, "unavailable") == 1
    assert deps.drafts.members["d:1"].breaker.state is BreakerState.CLOSED
