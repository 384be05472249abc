"""Placement of speculative legs by measured speed (gateway.draft_speeds): the rules alone, then
with in-memory drafts of different speeds behind real generations (no sockets)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from gateway_fakes import InMemoryDraft, InMemoryStream, InMemoryTarget, ScriptedModel
from test_fleet_failover import make_deps, make_request, run

from gateway.breaker import BreakerState
from gateway.draft_speeds import DraftSpeeds
from gateway.errors import TargetNotServed
from gateway.pool import Pool
from gateway.request import Speculation


@dataclass
class Draft:
    address: str


A, B, C = Draft("a:1"), Draft("b:1"), Draft("c:1")


def explored(speeds: DraftSpeeds, drafts: list[Draft], target: str = "t:1") -> None:
    """Places one leg on each draft in turn (the first legs of a target explore every draft)."""
    for i, draft in enumerate(drafts):
        assert speeds.choose(drafts, target) == drafts[i:]  # those never placed, none measured
        speeds.placed(draft.address, target)


def placed_legs(speeds: DraftSpeeds, drafts: list[Draft], legs: int, target: str = "t:1") -> list[tuple[str, int]]:
    """Places ``legs`` legs one after another as the gateway does (each on the one draft chosen):
    (address, probe budget) of each."""
    placed = []
    for _ in range(legs):
        (draft,) = speeds.choose(drafts, target)
        speeds.placed(draft.address, target)
        placed.append((draft.address, speeds.probe_budget(draft.address, target)))
    return placed


def test_unknown_drafts_are_tried_first_then_the_fastest_takes_the_legs():
    speeds = DraftSpeeds(explore_every=4, prior_rounds=0)
    drafts = [A, B]
    assert speeds.choose(drafts, "t:1") == drafts  # nothing known: both, least load decides
    explored(speeds, drafts)
    # Placed but not measured yet: neither is known, so both stay candidates.
    assert speeds.choose(drafts, "t:1") == drafts
    speeds.observe("a:1", "t:1", tokens=30, rounds=10, seconds=1.0)
    assert speeds.choose(drafts, "t:1") == [A]  # b:1 is pending: legs do not pile onto it
    speeds.observe("b:1", "t:1", tokens=60, rounds=10, seconds=1.0)
    assert speeds.choose(drafts, "t:1") == [B]
    assert speeds.to_json("b:1") == {"t:1": 60.0} and speeds.rate("a:1", "t:1") == 30.0


def test_drafts_within_the_tie_margin_are_equal_so_load_decides():
    speeds = DraftSpeeds(tie=0.05, prior_rounds=0)
    explored(speeds, [A, B, C])
    for draft, rate in ((A, 100.0), (B, 96.0), (C, 90.0)):
        speeds.observe(draft.address, "t:1", tokens=int(rate), rounds=10, seconds=1.0)
    assert speeds.choose([A, B, C], "t:1") == [A, B]


def test_a_draft_left_out_is_explored_again_after_explore_every_legs():
    speeds = DraftSpeeds(explore_every=5, explore_every_new=5)
    explored(speeds, [A, B])
    speeds.observe("a:1", "t:1", 10, 5, 1.0)
    speeds.observe("b:1", "t:1", 50, 5, 1.0)
    chosen = [address for address, _ in placed_legs(speeds, [A, B], 12)]
    # b:1 is the fastest; a:1 gets one leg once it has gone 5 legs without one.
    assert chosen.count("a:1") == 2 and chosen[4] == "a:1" and chosen[10] == "a:1"


def test_a_draft_measured_on_few_legs_is_explored_sooner():
    speeds = DraftSpeeds(explore_every=10, explore_every_new=2, known_legs=2)
    explored(speeds, [A, B])
    speeds.observe("b:1", "t:1", 50, 5, 1.0)
    chosen = []
    for _ in range(16):
        (draft,) = speeds.choose([A, B], "t:1")
        speeds.placed(draft.address, "t:1")
        if draft is A:
            speeds.observe("a:1", "t:1", 10, 5, 1.0)
        chosen.append(draft.address)
    # a:1 goes two legs without one, twice, until two of its legs are measured; then ten.
    assert [i for i, address in enumerate(chosen) if address == "a:1"] == [1, 4, 15]


def test_an_exploration_of_a_slower_or_unmeasured_draft_is_a_short_probe():
    speeds = DraftSpeeds(explore_every=3, explore_every_new=3, probe_tokens=16, prior_rounds=0)
    explored(speeds, [A, B])  # the first legs: nothing measured, nothing to compare, whole legs
    assert speeds.probe_budget("b:1", "t:1") == 0
    speeds.observe("a:1", "t:1", 10, 5, 1.0)
    speeds.observe("b:1", "t:1", 50, 5, 1.0)
    budgets = placed_legs(speeds, [A, B], 5)
    # b:1 is the fastest: whole legs; a:1 explored once it went three legs without one, for 16 tokens.
    assert budgets == [("b:1", 0), ("b:1", 0), ("a:1", 16), ("b:1", 0), ("b:1", 0)]
    assert speeds.probe_budget("a:1", "t:1") == 0  # a choice is read once
    # A draft never measured, explored beside one that is: a probe too.
    speeds.choose([A, B, C], "t:1")
    assert speeds.probe_budget("c:1", "t:1") == 16
    # One candidate (the others down): nothing is explored, the leg is whole.
    speeds.choose([A], "t:1")
    assert speeds.probe_budget("a:1", "t:1") == 0
    # Within the tie of the best: an exploration, not a probe.
    even = DraftSpeeds(explore_every=2, explore_every_new=2, prior_rounds=0, tie=0.05)
    explored(even, [A, B])
    even.observe("a:1", "t:1", 97, 5, 1.0)
    even.observe("b:1", "t:1", 100, 5, 1.0)
    even.placed("b:1", "t:1")  # a:1 has gone two legs without one
    assert even.choose([A, B], "t:1") == [A] and even.probe_budget("a:1", "t:1") == 0
    assert DraftSpeeds(probe_tokens=0).probe_budget("a:1", "t:1") == 0


def test_speeds_are_kept_per_target():
    speeds = DraftSpeeds(prior_rounds=0)
    explored(speeds, [A, B], "t:1")
    explored(speeds, [A, B], "u:1")
    speeds.observe("a:1", "t:1", 10, 5, 1.0)
    speeds.observe("b:1", "t:1", 20, 5, 1.0)
    speeds.observe("a:1", "u:1", 40, 5, 1.0)
    speeds.observe("b:1", "u:1", 20, 5, 1.0)
    assert speeds.choose([A, B], "t:1") == [B] and speeds.choose([A, B], "u:1") == [A]
    speeds.observe("b:1", "t:1", 0, 0, 1.0)  # a leg that committed nothing says nothing
    assert speeds.rate("b:1", "t:1") == 20.0


def test_time_per_round_follows_the_recent_rounds_and_tokens_per_round_many_prompts():
    """A prompt's predictability must not decide where legs go; a hop that grew must, at once."""
    speeds = DraftSpeeds(time_half_life_rounds=10, quality_half_life_rounds=1000, prior_rounds=0)
    speeds.observe("a:1", "t:1", tokens=30, rounds=10, seconds=1.0)  # 3 tokens a round, 0.1 s a round
    assert speeds.rate("a:1", "t:1") == pytest.approx(30.0)
    speeds.observe("a:1", "t:1", tokens=10, rounds=10, seconds=2.0)  # 1 token a round, 0.2 s a round
    # Tokens per round: both legs alike, ~2; seconds per round: the old leg at half weight,
    # (0.5 * 1.0 + 2.0) / (0.5 * 10 + 10) = 1/6 s.
    tokens_per_round = (30 * 0.5 ** 0.01 + 10) / (10 * 0.5 ** 0.01 + 10)
    assert speeds.rate("a:1", "t:1") == pytest.approx(tokens_per_round * 6)
    assert tokens_per_round == pytest.approx(2.0, abs=0.01)


def test_a_draft_measured_on_one_unlucky_prompt_is_judged_by_its_round_time():
    """b:1 runs rounds twice as fast (beside the target) but its one leg was on a prompt that
    lookup could not predict: its tokens per round are drawn towards the pool's until its own
    rounds outweigh them, so the round time decides."""
    speeds = DraftSpeeds(prior_rounds=64)
    explored(speeds, [A, B])
    speeds.observe("a:1", "t:1", tokens=300, rounds=100, seconds=10.0)  # 3 a round, 0.1 s a round
    speeds.observe("b:1", "t:1", tokens=5, rounds=5, seconds=0.25)  # 1 a round, 0.05 s a round
    assert speeds.choose([A, B], "t:1") == [B]
    assert DraftSpeeds(prior_rounds=0).choose([A, B], "t:1") == [A, B]  # (nothing known there)
    unshrunk = DraftSpeeds(prior_rounds=0)
    explored(unshrunk, [A, B])
    unshrunk.observe("a:1", "t:1", tokens=300, rounds=100, seconds=10.0)
    unshrunk.observe("b:1", "t:1", tokens=5, rounds=5, seconds=0.25)
    assert unshrunk.choose([A, B], "t:1") == [A]  # 30 against 20 tokens/s: one prompt's luck decides


def test_a_member_that_left_takes_its_speeds_along():
    speeds = DraftSpeeds()
    explored(speeds, [A, B], "t:1")
    explored(speeds, [A, B], "u:1")
    for target in ("t:1", "u:1"):
        speeds.observe("a:1", target, 10, 5, 1.0)
        speeds.observe("b:1", target, 10, 5, 1.0)
    speeds.forget("a:1")  # a draft
    speeds.forget("u:1")  # a target
    assert speeds.to_json("a:1") == {} and list(speeds.to_json("b:1")) == ["t:1"]


def test_one_candidate_is_always_chosen_and_bad_settings_are_refused():
    speeds = DraftSpeeds()
    assert speeds.choose([A], "t:1") == [A] and speeds.choose([], "t:1") == []
    with pytest.raises(ValueError):
        DraftSpeeds(tie=1.0)
    with pytest.raises(ValueError):
        DraftSpeeds(explore_every=4, explore_every_new=8)


def test_the_pool_places_among_the_preferred_members_by_load():
    pool = Pool.of("draft", {"a:1": "A", "b:1": "B", "c:1": "C"})
    pool.members["b:1"].sessions = 2
    prefer = lambda members: [m for m in members if m.address != "a:1"]
    assert pool.place(prefer=prefer).address == "c:1"
    assert pool.place(prefer=lambda members: []).address == "a:1"  # an empty preference is ignored


class SlowDraft(InMemoryDraft):
    """A draft whose every round takes ``delay_s`` longer (a far draft: each round crosses a hop)."""

    def __init__(self, model: ScriptedModel, delay_s: float) -> None:
        super().__init__(model)
        self.delay_s = delay_s

    async def _rounds(self, request):
        async for message in super()._rounds(request):
            await asyncio.sleep(self.delay_s)
            yield message


async def test_legs_go_to_the_draft_that_commits_faster_and_the_output_is_unchanged(tokenizer):
    model = ScriptedModel(tokenizer)
    near, far = SlowDraft(model, 0.0), SlowDraft(model, 0.02)
    deps = make_deps(tokenizer, {"t:1": InMemoryTarget(model)}, {"far:1": far, "near:1": near})
    deps.drafts.members["near:1"].sessions = 1  # least load alone would send every leg to far:1
    request = make_request(tokenizer, Speculation.ON)
    for _ in range(6):
        tokens, finished = await run(deps, request)
        assert tokens == model.expected_tokens(40, ignore_eos=True) and finished.finish_reason == "length"
    rates = deps.draft_speeds
    assert rates.rate("near:1", "t:1") > rates.rate("far:1", "t:1")
    # The far draft had the first leg (least load) and one exploration leg at most: the near one
    # measured faster.
    assert len(far.streams) <= 2 and len(near.streams) >= 4


class RecordingDraft(SlowDraft):
    """Records each call's budget (``max_new_tokens``; 0: the rest of the session)."""

    def __init__(self, model: ScriptedModel, delay_s: float) -> None:
        super().__init__(model, delay_s)
        self.budgets: list[int] = []

    def speculate(self, request):
        self.budgets.append(request.max_new_tokens)
        return super().speculate(request)


async def test_a_probe_of_the_slower_draft_is_short_and_the_request_goes_on_on_the_faster(tokenizer):
    model = ScriptedModel(tokenizer)
    near, far = RecordingDraft(model, 0.0), RecordingDraft(model, 0.03)
    deps = make_deps(tokenizer, {"t:1": InMemoryTarget(model)}, {"far:1": far, "near:1": near})
    deps.draft_speeds = DraftSpeeds(explore_every=3, explore_every_new=3, probe_tokens=6)
    deps.drafts.members["near:1"].sessions = 1  # the first leg goes to far:1 (least load)
    request = make_request(tokenizer, Speculation.ON)
    for _ in range(8):
        tokens, finished = await run(deps, request)
        assert tokens == model.expected_tokens(40, ignore_eos=True) and finished.finish_reason == "length"
    # far:1's first leg was a whole request; near:1's first a probe (unmeasured beside a measured
    # draft), then the rest of that request; afterwards far:1 gets probes only.
    assert far.budgets[0] == 0 and len(far.budgets) >= 2 and set(far.budgets[1:]) == {6}
    assert near.budgets[:2] == [6, 0] and 0 in near.budgets[2:]
    assert deps.draft_speeds.rate("near:1", "t:1") > deps.draft_speeds.rate("far:1", "t:1")


def test_a_draft_that_refuses_a_target_is_left_out_for_it_for_a_while():
    now = [0.0]
    speeds = DraftSpeeds(refusal_ttl_s=60.0, clock=lambda: now[0])
    speeds.refused("a:1", "t:1")
    assert speeds.choose([A, B], "t:1") == [B] and speeds.choose([A, B], "u:1") == [A, B]
    assert speeds.choose([A], "t:1") == []  # every candidate refuses: the caller says so
    now[0] = 61.0  # its pool may have grown since
    assert speeds.choose([A, B], "t:1") == [A, B] and not speeds.refuses("a:1", "t:1")


class PickyDraft(SlowDraft):
    """Serves only the targets named (as a draft started with --target-address of its own target)."""

    def __init__(self, targets: dict, serves: set[str]) -> None:
        super().__init__(next(iter(targets.values())).model, 0.0)
        self.targets, self.serves = targets, serves

    def speculate(self, request):
        if request.target_address not in self.serves:
            async def refused():
                raise TargetNotServed(f"the draft service at picky does not serve the target {request.target_address}",
                                      draft="picky", target=request.target_address)
                yield  # an async generator

            self.streams.append(InMemoryStream(refused()))
            return self.streams[-1]
        self.model = self.targets[request.target_address].model
        return super().speculate(request)


async def test_a_leg_refused_for_its_target_goes_to_a_draft_that_serves_it(tokenizer):
    a, b = ScriptedModel(tokenizer), ScriptedModel(tokenizer)
    targets = {"a:1": InMemoryTarget(a), "b:1": InMemoryTarget(b)}
    near_a, everywhere = PickyDraft(targets, {"a:1"}), PickyDraft(targets, {"a:1", "b:1"})
    deps = make_deps(tokenizer, targets, {"near-a:1": near_a, "all:1": everywhere})
    deps.targets.members["a:1"].sessions = 1  # the session goes to b:1
    deps.drafts.members["all:1"].sessions = 1  # its first leg to near-a:1, which refuses b:1
    tokens, finished = await run(deps, make_request(tokenizer, Speculation.ON))
    assert tokens == b.expected_tokens(40, ignore_eos=True) and finished.finish_reason == "length"
    assert len(near_a.streams) == 1 and len(everywhere.streams) >= 1
    assert deps.draft_speeds.refuses("near-a:1", "b:1") and not deps.draft_speeds.refuses("near-a:1", "a:1")
    assert deps.drafts.members["near-a:1"].breaker.state is BreakerState.CLOSED  # a refusal is no outage
    await run(deps, make_request(tokenizer, Speculation.ON))
    assert len(near_a.streams) == 1  # no more legs for b:1 there


async def test_a_target_no_draft_serves_is_a_clear_error(tokenizer):
    a, b = ScriptedModel(tokenizer), ScriptedModel(tokenizer)
    targets = {"a:1": InMemoryTarget(a), "b:1": InMemoryTarget(b)}
    deps = make_deps(tokenizer, targets, {"near-a:1": PickyDraft(targets, {"a:1"})})
    deps.targets.members["a:1"].sessions = 1
    with pytest.raises(TargetNotServed, match="no draft of the pool serves the target b:1"):
        await run(deps, make_request(tokenizer, Speculation.ON))
    # speculation "auto" decodes on with the target's Generate instead.
    tokens, finished = await run(deps, make_request(tokenizer, Speculation.AUTO))
    assert tokens == b.expected_tokens(40, ignore_eos=True)
