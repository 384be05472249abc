"""gateway.generation driven with in-memory upstreams (no sockets): modes, fallback, stops, cleanup."""

from __future__ import annotations

import pytest

from gateway.errors import UpstreamFailure, UpstreamUnavailable
from gateway.events import Finished, TextDelta
from gateway.counters import SessionCounters
from gateway.deps import GenerationDeps
from gateway.generation import Generation
from gateway.policy import Mode, SpeculationPolicy
from gateway.pool import Pool
from gateway.request import GenerationRequest, SamplingParams, Speculation
from gateway.served_model import ServedModel
from tandem.telemetry.metrics import make_metrics
from gateway_fakes import (
    SCRIPT_TEXT,
    InMemoryDraft,
    InMemoryStream,
    InMemoryTarget,
    ScriptedModel,
)

K = 4


@pytest.fixture
def model(tokenizer):
    return ScriptedModel(tokenizer)


def make_deps(tokenizer, model, *, draft=None, target=None, draft_ready=True):
    return GenerationDeps(
        targets=Pool.of("target", {"target": target or InMemoryTarget(model)}),
        drafts=Pool.of("draft", {"draft": draft or InMemoryDraft(model)}),
        model=ServedModel("tiny", tokenizer, 128),
        policy=SpeculationPolicy(),
        metrics=make_metrics("gateway"),
        draft_ready=lambda: draft_ready,
        default_num_speculative_tokens=K,
    )


def make_request(tokenizer, speculation=Speculation.ON, max_tokens=100, stop=(), ignore_eos=False):
    return GenerationRequest(
        prompt_token_ids=tuple(tokenizer("Once upon", add_special_tokens=False)["input_ids"]),
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None),
        stop=tuple(stop),
        stop_token_ids=(),
        ignore_eos=ignore_eos,
        speculation=speculation,
        num_speculative_tokens=None,
    )


async def run(deps, request):
    generation = Generation(request, deps)
    async with generation:
        await generation.start()
        events = [event async for event in generation.events()]
    deltas = [e for e in events if isinstance(e, TextDelta)]
    (finished,) = [e for e in events if isinstance(e, Finished)]
    assert events[-1] is finished
    tokens = [t for d in deltas for t in d.token_ids]
    return "".join(d.text for d in deltas), tokens, finished, generation


def sample(deps, name, **labels):
    return deps.metrics.registry.get_sample_value(name, labels) or 0.0


def idle(deps, model):
    active = sum(sample(deps, "tandem_sessions_active", mode=m) for m in ("speculative", "autoregressive"))
    return active == 0 and not model.sessions


async def test_speculative_decoding_streams_the_whole_script(tokenizer, model):
    deps = make_deps(tokenizer, model)
    text, tokens, finished, generation = await run(deps, make_request(tokenizer))
    assert text == SCRIPT_TEXT
    assert tokens == model.expected_tokens(1000)  # the script, then EOS
    assert finished.finish_reason == "stop"
    usage = finished.usage
    assert usage.prompt_tokens == len(generation.request.prompt_token_ids)
    assert usage.completion_tokens == len(tokens) and usage.total_tokens == usage.prompt_tokens + len(tokens)
    stats = usage.speculative_decoding
    assert stats.mode == "speculative" and stats.fallbacks == 0
    # After Prefill's first token, each fake round commits K // 2 accepted tokens + 1.
    per_round = K // 2 + 1
    rounds = -(-(len(tokens) - 1) // per_round)
    last_round = (len(tokens) - 1) - per_round * (rounds - 1)
    assert stats.rounds == rounds and stats.draft_tokens == K * rounds
    assert stats.accepted_tokens == (K // 2) * (rounds - 1) + min(K // 2, last_round)
    assert stats.acceptance_rate == pytest.approx(stats.accepted_tokens / stats.draft_tokens)
    assert sample(deps, "tandem_spec_decode_num_drafts_total") == stats.rounds
    assert sample(deps, "tandem_spec_decode_num_accepted_tokens_total") == stats.accepted_tokens
    assert [r.num_speculative_tokens for r in model.speculate_requests] == [K]
    assert list(model.speculate_requests[0].token_ids) == [*generation.request.prompt_token_ids, tokens[0]]
    assert model.released == [generation.session_id] and idle(deps, model)
    assert sample(deps, "tandem_requests_total", status="stop") == 1


class DraftWithoutDrafts(InMemoryDraft):
    """Verified blocks that carried no drafts (an eagle head before its first feature, or the
    block-length policy sending none): each round commits the target's tokens, nothing drafted."""

    async def _rounds(self, request):
        async for response in super()._rounds(request):
            response.num_draft_tokens = response.num_accepted = response.num_draft_positions = 0
            yield response


async def test_a_speculative_request_whose_blocks_carried_no_drafts_says_so(tokenizer, model):
    deps = make_deps(tokenizer, model, draft=DraftWithoutDrafts(model))
    text, tokens, finished, _ = await run(deps, make_request(tokenizer))
    assert text == SCRIPT_TEXT
    stats = finished.usage.speculative_decoding
    assert (stats.mode, stats.rounds, stats.draft_tokens) == ("speculative", 0, 0)
    assert stats.empty_rounds == -(-(len(tokens) - 1) // (K // 2 + 1)) > 0
    assert stats.to_json()["empty_rounds"] == stats.empty_rounds
    assert sample(deps, "tandem_spec_decode_num_drafts_total") == 0


async def test_speculation_off_uses_target_generate_and_gives_the_same_output(tokenizer, model):
    spec = await run(make_deps(tokenizer, model), make_request(tokenizer, Speculation.ON))
    deps = make_deps(tokenizer, model)
    text, tokens, finished, generation = await run(deps, make_request(tokenizer, Speculation.OFF))
    assert (text, tokens, finished.finish_reason) == spec[:2] + (spec[2].finish_reason,)
    assert ("Generate", generation.session_id) in model.rpcs
    assert ("Speculate", generation.session_id) not in model.rpcs
    stats = finished.usage.speculative_decoding
    assert (stats.mode, stats.rounds, stats.draft_tokens, stats.acceptance_rate) == ("autoregressive", 0, 0, 0.0)


async def test_max_tokens_finishes_with_length_mid_round(tokenizer, model):
    deps = make_deps(tokenizer, model)
    text, tokens, finished, _ = await run(deps, make_request(tokenizer, max_tokens=5))
    assert tokens == model.expected_tokens(5)
    assert finished.finish_reason == "length" and finished.usage.completion_tokens == 5
    assert text == "Hello"


async def test_stop_string_truncates_cancels_upstream_and_releases(tokenizer, model):
    draft = InMemoryDraft(model)
    deps = make_deps(tokenizer, model, draft=draft)
    text, tokens, finished, generation = await run(deps, make_request(tokenizer, stop=["rld"]))
    assert text == "Hello wö"
    assert finished.finish_reason == "stop"
    # Tokens up to the one completing the stop string count; later ones of the same round do not.
    assert tokenizer.decode(tokens) == "Hello wörld"
    assert finished.usage.completion_tokens == len(tokens)
    assert draft.streams[-1].cancelled
    assert model.released == [generation.session_id] and idle(deps, model)


async def test_auto_with_draft_known_down_falls_back_without_trying_it(tokenizer, model):
    deps = make_deps(tokenizer, model, draft_ready=False)
    text, _, finished, generation = await run(deps, make_request(tokenizer, Speculation.AUTO))
    assert text == SCRIPT_TEXT
    stats = finished.usage.speculative_decoding
    assert (stats.mode, stats.fallbacks) == ("autoregressive", 1)
    assert ("Speculate", generation.session_id) not in model.rpcs
    assert sample(deps, "tandem_session_fallbacks_total", reason="draft_unavailable") == 1


async def test_auto_falls_back_when_the_draft_is_unreachable_at_start(tokenizer, model):
    deps = make_deps(tokenizer, model, draft=InMemoryDraft(model, fail_after_rounds=0))
    text, tokens, finished, _ = await run(deps, make_request(tokenizer, Speculation.AUTO))
    assert text == SCRIPT_TEXT and tokens == model.expected_tokens(1000)
    stats = finished.usage.speculative_decoding
    assert (stats.mode, stats.fallbacks, stats.rounds) == ("autoregressive", 1, 0)
    assert sample(deps, "tandem_session_fallbacks_total", reason="draft_unavailable") == 1
    assert idle(deps, model)


async def test_auto_survives_a_draft_crash_mid_stream_without_losing_tokens(tokenizer, model):
    deps = make_deps(tokenizer, model, draft=InMemoryDraft(model, fail_after_rounds=2))
    text, tokens, finished, _ = await run(deps, make_request(tokenizer, Speculation.AUTO))
    assert text == SCRIPT_TEXT and tokens == model.expected_tokens(1000)
    stats = finished.usage.speculative_decoding
    assert (stats.mode, stats.fallbacks, stats.rounds) == ("mixed", 1, 2)
    assert idle(deps, model)


async def test_speculation_on_fails_when_the_draft_is_unreachable(tokenizer, model):
    deps = make_deps(tokenizer, model, draft=InMemoryDraft(model, fail_after_rounds=0))
    generation = Generation(make_request(tokenizer, Speculation.ON), deps)
    with pytest.raises(UpstreamUnavailable):
        async with generation:
            await generation.start()
            async for _ in generation.events():
                pass
    assert model.released == [generation.session_id] and idle(deps, model)
    assert sample(deps, "tandem_requests_total", status="error") == 1


class _LossyTarget(InMemoryTarget):
    """Drops the second Generate message, as a broken upstream might."""

    def generate(self, request):
        async def lossy():
            index = 0
            async for message in self.model.generate_stream(request.session_id):
                if index != 1:
                    yield message
                index += 1

        return InMemoryStream(lossy())


async def test_a_gap_in_committed_tokens_fails_the_request(tokenizer, model):
    deps = make_deps(tokenizer, model, target=_LossyTarget(model))
    generation = Generation(make_request(tokenizer, Speculation.OFF), deps)
    with pytest.raises(UpstreamFailure, match="out of step"):
        async with generation:
            await generation.start()
            async for _ in generation.events():
                pass
    assert idle(deps, model)


async def test_closing_mid_stream_cancels_upstream_and_releases(tokenizer, model):
    draft = InMemoryDraft(model)
    deps = make_deps(tokenizer, model, draft=draft)
    generation = Generation(make_request(tokenizer, ignore_eos=True, max_tokens=100), deps)
    await generation.start()
    events = generation.events()
    await anext(events)  # the first token
    await anext(events)  # the first speculation round
    await events.aclose()
    await generation.aclose()
    assert draft.streams[-1].cancelled
    assert model.released == [generation.session_id] and idle(deps, model)
    assert sample(deps, "tandem_requests_total", status="abort") == 1


async def test_failed_prefill_still_releases(tokenizer, model):
    class FailingTarget(InMemoryTarget):
        async def prefill(self, request):
            raise UpstreamFailure("the target service failed (INTERNAL): boom")

    deps = make_deps(tokenizer, model, target=FailingTarget(model))
    generation = Generation(make_request(tokenizer), deps)
    with pytest.raises(UpstreamFailure):
        async with generation:
            await generation.start()
    assert model.released == [generation.session_id] and idle(deps, model)
    assert sample(deps, "tandem_requests_total", status="error") == 1


async def test_unreachable_target_is_not_asked_to_release(tokenizer, model):
    class DownTarget(InMemoryTarget):
        async def prefill(self, request):
            raise UpstreamUnavailable("the target service is unavailable")

    deps = make_deps(tokenizer, model, target=DownTarget(model))
    generation = Generation(make_request(tokenizer), deps)
    with pytest.raises(UpstreamUnavailable):
        async with generation:
            await generation.start()
    assert model.released == [] and idle(deps, model)


def test_session_counters_move_the_count_and_the_gauge_together():
    metrics = make_metrics("gateway")
    counters = SessionCounters(metrics)

    def gauge(mode):
        return metrics.registry.get_sample_value("tandem_sessions_active", {"mode": mode.value})

    counters.started(Mode.SPECULATIVE)
    counters.started(Mode.AUTOREGRESSIVE)
    counters.switched(Mode.SPECULATIVE, Mode.AUTOREGRESSIVE)
    counters.fell_back("low_acceptance")
    assert counters.active_sessions == 2 and (gauge(Mode.SPECULATIVE), gauge(Mode.AUTOREGRESSIVE)) == (0, 2)
    assert metrics.registry.get_sample_value("tandem_session_fallbacks_total", {"reason": "low_acceptance"}) == 1
    counters.ended(Mode.AUTOREGRESSIVE)
    assert counters.active_sessions == 1 and gauge(Mode.AUTOREGRESSIVE) == 1
