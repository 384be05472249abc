"""Cutting proposals to the length that pays (``draft_service.block_length``), and the sources
the proposers name for it."""

from __future__ import annotations

import numpy as np
import pytest
from draft_fakes import InMemoryVerifier, ReferenceTarget, generate_greedy, load_tiny

from draft_service.block_length import (
    PRIOR_WEIGHT,
    AcceptanceTally,
    BlockLengthPolicy,
    PriorFileError,
    confidence_source,
    load_prior,
    save_prior,
)
from draft_service.loop import SpeculationLoop
from draft_service.proposers.hf import HfProposer
from draft_service.proposers.ngram import NgramProposer, agreeing_run, match_bucket
from draft_service.types import FinishReason, Proposal, SamplingParams, SessionSpec, SparseDist
from tandem.pass_costs import COST_WINDOW, MIN_COST_SAMPLES

PROMPT = (2, 40, 41, 42, 43, 44, 45, 46)


def policy_with_costs(costs_ms: dict[int, float], explore_every: int = 0) -> BlockLengthPolicy:
    policy = BlockLengthPolicy(explore_every=explore_every)
    for rows, ms in costs_ms.items():
        for _ in range(MIN_COST_SAMPLES):
            policy.costs.observe(rows, ms / 1000)
    return policy


def test_a_verdict_counts_accepted_drafts_the_rejected_one_and_not_those_after_it():
    tally = AcceptanceTally()
    tally.observe(["a", "a", "a", "a"], num_accepted=2)
    assert tally.estimate("a", 0) == pytest.approx(2 / 3)  # (1 accepted + 1) / (1 offered + 2)
    assert tally.estimate("a", 1) == pytest.approx(2 / 3)
    assert tally.estimate("a", 2) == pytest.approx(1 / 3)  # offered and rejected
    assert tally.estimate("a", 3) == 0.5  # never judged: the prior
    tally.observe(["b"], num_accepted=1)  # the whole block accepted
    assert tally.estimate("b", 0) == pytest.approx(2 / 3)


def test_deep_drafts_share_a_tally_and_blending_weighs_the_prior():
    tally = AcceptanceTally()
    tally.observe(["a"] * 8, num_accepted=8)
    assert tally.estimate("a", 6) == tally.estimate("a", 4) == pytest.approx((4 + 1) / (4 + 2))
    assert tally.blended("a", 0, prior=0.0, weight=1.0) == pytest.approx(0.5)  # 1 of 1 against 0 seen once
    assert tally.blended("unseen", 0, prior=0.3, weight=8.0) == pytest.approx(0.3)


def test_a_prior_sets_the_first_estimates_and_the_text_served_outvotes_it():
    tally = AcceptanceTally({("lookup:8", 0): 0.9, ("lookup:8", 4): 0.6})
    assert tally.estimate("lookup:8", 0) == pytest.approx((1 + PRIOR_WEIGHT * 0.9) / (2 + PRIOR_WEIGHT))
    assert tally.estimate("lookup:8", 7) == tally.estimate("lookup:8", 4)  # deep drafts share the last bucket
    assert tally.estimate("lookup:8", 1) == 0.5  # no prior there: Laplace
    for _ in range(200):  # this text copies badly
        tally.observe(["lookup:8"], num_accepted=0)
    assert tally.estimate("lookup:8", 0) < 0.1


def test_measured_rates_round_trip_through_a_prior_file(tmp_path):
    tally = AcceptanceTally()
    for _ in range(10):
        tally.observe(["lookup:8", "lookup:8", "head:0.7"], num_accepted=1)
    tally.observe(["rare"], num_accepted=1)  # judged once: too few to record
    rates = tally.rates()
    assert rates == {("lookup:8", 0): 1.0, ("lookup:8", 1): 0.0}  # the head draft after them was never judged
    path = tmp_path / "acceptance.json"
    save_prior(path, rates, measured_on="a test")
    assert load_prior(path) == rates
    assert BlockLengthPolicy(prior=load_prior(path)).acceptance.estimate("lookup:8", 1) < 0.1


@pytest.mark.parametrize(
    "text",
    ["not json", '{"format": 99, "rates": {}}', '{"format": 1}', '{"format": 1, "rates": {"a": [1.5]}}',
     '{"format": 1, "rates": {"a": [0.1, 0.1, 0.1, 0.1, 0.1, 0.1]}}', '{"format": 1, "rates": {"a": "high"}}',
     '{"format": 1, "rates": {"a": [true]}}'],
)
def test_a_malformed_prior_file_is_a_clear_error(tmp_path, text):
    path = tmp_path / "acceptance.json"
    path.write_text(text)
    with pytest.raises(PriorFileError, match="acceptance prior"):
        load_prior(path)


def test_a_fresh_policy_with_a_prior_keeps_the_long_copies_a_coin_flip_would_cut():
    costs = {1: 40, 2: 41, 4: 42, 6: 43, 8: 50}
    sources = ["lookup:8"] * 7
    fresh = policy_with_costs(costs)
    prior = {("lookup:8", depth): 0.95 for depth in range(5)}
    warmed = BlockLengthPolicy(explore_every=0, prior=prior)
    warmed.costs = fresh.costs
    assert fresh.length(sources) < 7 <= warmed.length(sources)


@pytest.mark.parametrize(
    ("probability", "source"), [(0.0, "head:0.0"), (0.749, "head:0.7"), (0.75, "head:0.7"), (1.0, "head:0.9")]
)
def test_confidence_sources_are_tenths(probability, source):
    assert confidence_source("head", probability) == source


def test_without_costs_or_sources_a_proposal_goes_whole():
    policy = BlockLengthPolicy()
    assert policy.length(["lookup:1"] * 5) == 5
    assert policy_with_costs({1: 10, 2: 10}).length([]) == 0


def test_a_cheap_wider_pass_keeps_every_draft():
    policy = policy_with_costs({1: 10, 8: 10})
    assert policy.length(["lookup:1"] * 7) == 7


def test_a_costly_wider_pass_cuts_unlikely_drafts_before_it():
    policy = policy_with_costs({1: 10, 2: 10, 3: 10, 4: 12, 5: 12})
    for _ in range(20):
        policy.acceptance.observe(["x"] * 4, num_accepted=0)
        policy.acceptance.observe(["x"] * 4, num_accepted=1)
    assert policy.length(["x"] * 4) == 2  # as far as the pass costs the same
    for _ in range(200):  # drafts that always pass are worth the dearer pass
        policy.acceptance.observe(["sure"] * 4, num_accepted=4)
    assert policy.length(["sure"] * 4) == 4


def test_when_no_draft_pays_for_a_wider_pass_the_block_is_empty():
    policy = policy_with_costs({1: 10, 2: 20})
    for _ in range(50):
        policy.acceptance.observe(["junk"], num_accepted=0)
    assert policy.length(["junk"] * 3) == 0


def test_the_sessions_own_record_can_outweigh_the_services():
    policy = policy_with_costs({1: 10, 2: 10, 3: 12})
    for _ in range(100):
        policy.acceptance.observe(["x", "x"], num_accepted=0)
    assert policy.length(["x", "x"]) == 1
    session = AcceptanceTally()
    for _ in range(50):
        session.observe(["x", "x"], num_accepted=2)
    assert policy.length(["x", "x"], session) == 2


def test_every_so_often_a_proposal_goes_whole_to_keep_learning():
    policy = policy_with_costs({1: 10, 2: 20}, explore_every=4)
    for _ in range(50):
        policy.acceptance.observe(["junk"], num_accepted=0)
    assert [policy.length(["junk"] * 3) for _ in range(8)] == [0, 0, 0, 3, 0, 0, 0, 3]


def test_propose_time_counts_as_overhead_of_every_length():
    # Without overhead one draft at 0.5 is not worth a pass twice as dear; with a large fixed
    # overhead the dearer pass matters less than the extra token.
    policy = policy_with_costs({1: 10, 2: 20})
    policy.acceptance.observe(["x"], num_accepted=1)  # estimate 2/3
    assert policy.length(["x"]) == 0
    for _ in range(5):
        policy.observe(["x"], 1, rows=2, seconds=0.020, propose_seconds=0.100)
    assert policy.length(["x"]) == 1


def test_a_round_is_priced_as_the_targets_pass_plus_the_hop_to_it():
    """Verdicts that report the target's pass: the pass by width is learned apart from the round
    trip, and the round trip to the session's target decides how long a block pays: far targets
    get longer blocks (issue 28 §2)."""
    policy = BlockLengthPolicy(explore_every=0)
    for _ in range(5):  # passes of 10 ms (1 row) and 20 ms (2 rows), each round 30 ms more on the wire
        policy.observe([], 0, rows=1, seconds=0.040, propose_seconds=0.0, verify_seconds=0.010)
        policy.observe([], 0, rows=2, seconds=0.050, propose_seconds=0.0, verify_seconds=0.020)
    assert policy.costs.medians() == {1: 0.010, 2: 0.020}
    policy.acceptance.observe(["x"], num_accepted=1)  # estimate 2/3: worth 1.67 tokens for a 2-row pass
    # A target on loopback: 1 token / 10 ms beats 1.67 / 20 ms: no draft.
    assert policy.length(["x"], transport_s=0.0) == 0
    # A target 30 ms away: 1.67 / 50 ms beats 1 / 40 ms: the draft goes.
    assert policy.length(["x"], transport_s=0.030) == 1
    # Without a target's own figure, the service's median round trip (30 ms here) prices it.
    assert policy.length(["x"]) == 1


def test_beside_other_sessions_a_draft_must_pay_for_the_pass_everyone_waits_for():
    """A block in a shared pass is priced at what its rows add to the whole pass: beside sessions
    that commit a token a row it must bring as much per second of pass, beside a prompt chunk
    (rows that commit nothing) its rows are nearly free. The verdicts name the pass."""
    costs = {rows: 10.0 + rows for rows in range(1, 41)}  # ms: a pass bound by arithmetic, 1 ms a row
    policy = BlockLengthPolicy(explore_every=0, prior={("x", depth): 0.5 for depth in range(5)})
    for rows, ms in costs.items():
        for _ in range(MIN_COST_SAMPLES):
            policy.costs.observe(rows, ms / 1000)
    assert policy.others() == (0.0, 0.0)
    assert policy.length(["x"] * 4) == 2  # alone: 1.75 tokens / 13 ms beats 1 / 11 and 1.94 / 15

    for _ in range(5):  # its blocks shared their passes with 24 one-token decode steps
        policy.observe([], 0, rows=1, seconds=None, propose_seconds=0.0, verify_seconds=0.035, pass_rows=25,
                       pass_tokens=25, committed=1)
    assert policy.others() == (24.0, 24.0)
    assert policy.costs.medians()[25] == pytest.approx(0.035)  # the pass is learned by its rows
    assert policy.length(["x"] * 4) == 0  # 25 tokens / 35 ms: no draft at 0.5 adds 0.71 a ms

    for _ in range(COST_WINDOW):  # then beside a prompt's chunk of 24 rows that commits nothing
        policy.observe([], 0, rows=1, seconds=None, propose_seconds=0.0, verify_seconds=0.035, pass_rows=25,
                       pass_tokens=1, committed=1)
    assert policy.others() == (24.0, 0.0)
    assert policy.length(["x"] * 4) == 4  # 1.94 tokens / 39 ms beats 1 / 35

    for _ in range(COST_WINDOW):  # a target that names no pass: alone, as before
        policy.observe([], 0, rows=1, seconds=None, propose_seconds=0.0, verify_seconds=0.011)
    assert policy.others() == (0.0, 0.0) and policy.length(["x"] * 4) == 2


def test_a_cut_proposal_keeps_its_q_and_sources_aligned():
    proposal = Proposal((5, 6, 7), tuple(SparseDist((t,), (1.0,)) for t in (5, 6, 7)), ("a", "b", "c"))
    cut = proposal.cut(2)
    assert cut.token_ids == (5, 6) and cut.sources == ("a", "b") and len(cut.probs) == 2
    assert proposal.cut(3) is proposal and proposal.cut(0).token_ids == ()
    with pytest.raises(ValueError, match="sources"):
        Proposal((1, 2), sources=("a",))


def test_lookup_names_how_long_the_copied_context_has_agreed():
    tokens = np.array([9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6])
    # The suffix's last 4 tokens recur at 3..6; the agreement reaches back 6 tokens to the 1.
    assert agreeing_run(tokens, start=7, n=4) == 6
    assert [match_bucket(r) for r in (1, 2, 3, 4, 7, 8, 15, 16, 40)] == [1, 2, 3, 4, 4, 8, 8, 16, 16]
    session = NgramProposer(ngram_max=4).new_session(tokens.tolist(), SamplingParams())
    proposal = session.propose(3)
    assert proposal.token_ids == (7, 8, 0) and proposal.sources == ("lookup:4",) * 3


async def run_inline(fn, *args):
    return fn(*args)


async def test_the_loop_sends_cut_blocks_and_the_output_stays_the_targets(tiny_dir):
    target = load_tiny(tiny_dir)
    n = 24
    reference = ReferenceTarget(target.model, (target.tokenizer.eos_token_id,))
    first, _ = reference.prefill("s", PROMPT, max_new_tokens=n)
    committed = (*PROMPT, first)
    verifier = InMemoryVerifier(reference)
    # Passes past three rows look a thousand times dearer: blocks keep two drafts.
    policy = policy_with_costs({1: 1, 2: 1, 3: 1, 4: 1000, 5: 1000})
    spec = SessionSpec(
        "s", committed, len(PROMPT), SamplingParams(), num_speculative_tokens=4, session_max_new_tokens=n
    )
    session = HfProposer(target).new_session(committed, SamplingParams())  # drafts name "model:..." sources
    loop = SpeculationLoop(spec, session, verifier, run_inline, lengths=policy)
    results = [result async for result in loop.rounds()]
    streamed = [token for result in results for token in result.token_ids]
    assert [first, *streamed] == generate_greedy(target.model, PROMPT, n, target.tokenizer.eos_token_id)
    assert results[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert max(len(block.proposal.token_ids) for block in verifier.blocks) == 2
    assert all(source.startswith("model:") for block in verifier.blocks for source in block.proposal.sources)
    assert policy.acceptance.estimate(verifier.blocks[0].proposal.sources[0], 0) > 0.5  # it learned


def test_the_learned_costs_are_logged_for_operators_at_debug(caplog):
    policy = BlockLengthPolicy()
    with caplog.at_level("DEBUG", logger="draft_service.block_length"):
        for _ in range(256):
            policy.observe(["x"], 1, rows=2, seconds=0.020, propose_seconds=0.001)
    assert "after 256 rounds: round ms by block width {2: 20.0}" in caplog.text
