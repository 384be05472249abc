"""The pipelined speculation loop (draft_service.pipeline): blocks sent before the verdicts of the
ones before them. Lossless against the reference target whatever the assumptions (all hold: the
target's own weights; some fail: a nearby model; many fail: another model, prompt lookup), no
committed token left unstreamed when a call's budget ends with blocks in flight, and the engine
over gRPC with the real target."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from draft_fakes import InMemoryVerifier, generate_greedy
from scipy.stats import chisquare
from test_draft_loop import PROMPT, collect, run_inline, start_session, streamed

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


async def test_pipelined_speculation_over_grpc_equals_generate(target, monkeypatch):
    """The draft service with --pipeline-depth 2 against the real target service (sending ahead
    whatever the hop costs: over loopback the measured rule would rarely)."""
    from draft_service.hop import HopStats

    monkeypatch.setattr(HopStats, "send_ahead", lambda self, rank=0: True)
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
                                 target_wait_s=10, pipeline_depth=2, pipeline_hedges=1)  # no hedges: none goes stale
    try:
        request = await prefill(address, target, "piped", n)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{drafting.port}") as channel:
            replies = [r async for r in draft_pb2_grpc.DraftServiceStub(channel).Speculate(request)]
        assert replies[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        tokens = [request.token_ids[-1], *(t for r in replies for t in r.token_ids)]
        assert tokens == generate_greedy(target.model, E2E_PROMPT, n, target.tokenizer.eos_token_id)
        # The same weights draft: assumptions hold, and the metric counts them.
        held = drafting.engine._metrics.pipelined_blocks.labels(outcome="verified")._value.get()
        stale = drafting.engine._metrics.pipelined_blocks.labels(outcome="stale")._value.get()
        assert held >= 2 and stale == 0
    finally:
        await drafting.stop(0)
        await served.stop(0)


# --------------------------------------------------------------------------- the eagle head's drafters


@pytest.fixture(scope="module")
def eagle_head(target, tmp_path_factory):
    from test_draft_eagle import make_head

    return make_head(tmp_path_factory.mktemp("head"), target)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("drafter", ["eagle", "ngram+eagle trees", "ngram+eagle chains"])
async def test_pipelined_eagle_drafters_are_lossless_and_draft_on_their_own_features(target, eagle_head, drafter,
                                                                                     depth):
    """Assumed tokens bring no hidden states: the head rolls its own features over them and keeps
    drafting (trees: along their most probable path), and the output is still the target's."""
    from test_draft_eagle import PROMPT as EAGLE_PROMPT
    from test_draft_eagle import load_eagle, speculate_in_process

    from draft_service.proposers.ngram_first import NgramFirstProposer

    n = 32
    eagle = load_eagle(eagle_head, target)
    proposer = {"eagle": lambda: eagle,
                "ngram+eagle trees": lambda: NgramFirstProposer(NgramProposer(), eagle, tree_nodes=5,
                                                                measure_shapes=False),
                "ngram+eagle chains": lambda: NgramFirstProposer(NgramProposer(), eagle)}[drafter]()
    tokens, _, blocks = await speculate_in_process(target, proposer, n, k=3, depth=depth)
    assert tokens == generate_greedy(target.model, EAGLE_PROMPT, n, target.tokenizer.eos_token_id)
    assumed = [b for b in blocks if b.assumed_token_ids]
    assert assumed and any(b.proposal.token_ids for b in assumed)  # drafted past a guess, on rolled features
    if drafter == "ngram+eagle trees":
        after_tree = [b for before, b in itertools.pairwise(blocks) if before.proposal.parents and b.assumed_token_ids]
        assert after_tree  # a tree's most probable path taken as accepted
        for before, block in itertools.pairwise(blocks):
            if block.assumed_token_ids and before.proposal.parents and before.base_len == block.base_len:
                path, skip = before.proposal.likely_path(), len(before.assumed_token_ids)
                assert block.assumed_token_ids[skip: skip + len(path)] == path


@pytest.mark.parametrize("depth", [1, 2])
async def test_measured_block_shapes_are_lossless_and_learn_from_the_rounds(target, eagle_head, depth):
    """Trees and chains chosen by measured rates (the default): greedy output is the target's, both
    shapes are drafted while the choice learns, and the rounds of a block sent alone report back."""
    from test_draft_eagle import PROMPT as EAGLE_PROMPT
    from test_draft_eagle import load_eagle, speculate_in_process

    from draft_service.proposers.ngram_first import NgramFirstProposer

    n = 32
    proposer = NgramFirstProposer(NgramProposer(), load_eagle(eagle_head, target), tree_nodes=5)
    tokens, results, blocks = await speculate_in_process(target, proposer, n, k=3, depth=depth)
    assert tokens == generate_greedy(target.model, EAGLE_PROMPT, n, target.tokenizer.eos_token_id)
    shaped = [block.proposal for block in blocks if block.proposal.shape]
    assert {p.shape for p in shaped} == {"tree", "chain"}
    assert all(bool(p.parents) == (p.shape == "tree") for p in shaped)
    reported = sum(len(tally.rounds) for tally in proposer.block_shapes._tallies.values())
    if depth == 1:  # every round is its own
        assert reported == sum(1 for block in blocks if block.proposal.shape and not block.assumed_token_ids) > 0
    else:  # blocks sent ahead of a verdict are not
        assert reported < len(shaped)


@pytest.mark.parametrize("depth", [1, 2])
async def test_sampled_sessions_send_token_trees_and_a_seeded_session_repeats_itself(target, eagle_head, depth):
    """Sampled sessions draft trees too (the target's draws walk them; the distribution:
    tests/test_target_sampling.py): the loop runs them to the end, accepts root paths, and the
    same seeds give the same tokens."""
    from test_draft_eagle import load_eagle, speculate_in_process

    from draft_service.proposers.ngram_first import NgramFirstProposer

    n, eagle = 32, load_eagle(eagle_head, target)
    runs = []
    for _ in range(2):
        proposer = NgramFirstProposer(NgramProposer(), eagle, tree_nodes=5, measure_shapes=False)
        tokens, results, blocks = await speculate_in_process(target, proposer, n, k=3, depth=depth, temperature=0.8,
                                                             seed=5)
        assert results[-1].finish_reason is not FinishReason.NONE and any(block.proposal.parents for block in blocks)
        assert all(not block.proposal.probs for block in blocks if block.proposal.parents)
        runs.append(tokens)
    assert runs[0] == runs[1]


async def test_the_heads_rollout_reuses_what_it_predicted_and_is_bounded(
        target, eagle_head, monkeypatch):
    """The rollout reuses what the head predicted while drafting: tokens the head drafted itself
    cost no step when taken as committed."""
    from test_draft_eagle import load_eagle

    eagle = load_eagle(eagle_head, target)
    session = eagle.new_session(PROMPT, SamplingParams())
    hidden = torch.randn(2, eagle.drafter.config.hidden_size)
    session.commit(len(PROMPT), (11, 12), hidden)
    block = session.propose(3)
    assert len(block.token_ids) >= 1
    steps = []
    step = eagle.drafter.step
    monkeypatch.setattr(eagle.drafter, "step", lambda *a: steps.append(1) or step(*a))
    session.commit(len(PROMPT) + 2, block.token_ids, None)  # the whole block taken as accepted
    assert session.has_feature and steps == []
    # Rolled back to the verdict: its own feature again.
    session.commit(len(PROMPT) + 2, (), None)
    torch.testing.assert_close(session.feature, hidden[-1])
    # Tokens the head did not draft cost a step each, and past MAX_ROLLOUT none is taken.
    from draft_service.proposers.rollout import MAX_ROLLOUT

    session.commit(len(PROMPT) + 2, (5, 6, 7), None)
    assert session.has_feature and len(steps) == 3
    session.commit(len(PROMPT) + 2, tuple(range(5, 6 + MAX_ROLLOUT)), None)
    assert not session.has_feature and len(steps) == 3
    # A verdict that accepts part of a block moves the anchor; what the head predicted past it is
    # kept, so the rest of the block taken as committed still costs no step.
    session.commit(len(PROMPT) + 2, (), None)
    block = session.propose(3)
    assert len(block.token_ids) >= 2
    drafted = len(steps)
    session.commit(len(PROMPT) + 2, block.token_ids[:1], torch.randn(1, eagle.drafter.config.hidden_size))
    session.commit(len(PROMPT) + 3, block.token_ids[1:], None)
    assert session.has_feature and len(steps) == drafted


# --------------------------------------------------------------------------- sampling, statistically


async def test_pipelined_sampling_matches_the_target_distribution(small_vocab_target, one_thread):
    """Blocks drafted on a guessed bonus token are verified only when the target committed exactly
    that token: the joint distribution of the first 3 generated tokens over 1500 trials is the
    target's (chi-square and total variation against the exact joint, as tests/test_target_sampling.py does for one
    block), with assumptions that held and ones that failed in the same trials."""
    from test_draft_eagle import EngineVerifier
    from test_target_sampling import PROMPT as SMALL_PROMPT
    from test_target_sampling import VOCAB, exact_joint
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.models import LoadedModel
    from target_service.engine import TargetEngine
    from target_service.session import SessionConfig

    torch.manual_seed(12)  # a draft over the same 5 tokens with other weights
    base = small_vocab_target.model
    draft_model = LlamaForCausalLM(LlamaConfig(**{**base.config.to_dict(), "num_hidden_layers": 1})).eval()
    loaded = LoadedModel("vocab5-draft", draft_model, small_vocab_target.tokenizer, small_vocab_target.hf_dir,
                         "float32", "cpu")
    proposer = HfProposer(loaded, vocab_limit=VOCAB)
    engine = TargetEngine(small_vocab_target)
    temperature, trials = 1.0, 1500
    counts = np.zeros((VOCAB,) * 3)
    held = stale = 0
    for trial in range(trials):
        first = engine.prefill("s", SMALL_PROMPT, SessionConfig(max_new_tokens=8, temperature=temperature, seed=trial,
                                                                ignore_eos=True))
        committed = (*SMALL_PROMPT, first.token_id)
        sampling = SamplingParams(temperature=temperature, seed=10_000 + trial)
        spec = SessionSpec("s", committed, len(SMALL_PROMPT), sampling, 2, session_max_new_tokens=8)
        loop = PipelinedLoop(spec, proposer.new_session(committed, sampling), EngineVerifier(engine), run_inline,
                             depth=2)
        results = await collect(loop)
        tokens = [first.token_id, *streamed(results)]
        assert len(tokens) == 8 and results[-1].finish_reason is FinishReason.LENGTH
        counts[tuple(tokens[:3])] += 1
        held, stale = held + loop.held_blocks, stale + loop.stale_blocks
        engine.release("s")
    assert held > trials // 5 and stale > trials // 5  # both paths, often
    expected = exact_joint(base, temperature, 0.0, 0).ravel()
    counts = counts.ravel()
    assert counts[expected == 0].sum() == 0
    expected_counts = expected * trials
    big = expected_counts >= 5
    observed, wanted = counts[big], expected_counts[big]
    if (~big & (expected > 0)).any():
        observed = np.append(observed, counts[~big & (expected > 0)].sum())
        wanted = np.append(wanted, expected_counts[~big & (expected > 0)].sum())
    wanted = wanted * observed.sum() / wanted.sum()
    p_value = chisquare(observed, wanted).pvalue
    tv = 0.5 * np.abs(counts / trials - expected).sum()
    mean_tv = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * trials)) for p in expected)
    assert p_value > 1e-3 and tv < 1.5 * mean_tv, f"chi-square p={p_value:.2e}, TV={tv:.4f} (exact ~{mean_tv:.4f})"


def test_verdicts_that_arrive_before_the_next_proposal_reach_the_proposer_as_one_commit():
    from draft_service.errors import ProtocolError
    from draft_service.pipeline import _after

    states = torch.randn(5, 4)  # [committed, hidden]
    first, second = (10, (1, 2), states[:2]), (12, (3, 4, 5), states[2:])
    base, tokens, merged = _after(_after(None, first), second)
    assert (base, tokens) == (10, (1, 2, 3, 4, 5)) and torch.equal(merged, states)
    assert _after((10, (), None), first) == first  # a roll back to the confirmed length, then the verdict
    assert _after(first, (12, (3,), None))[2] is None  # states for some rows only: none (the head rolls its own)
    with pytest.raises(ProtocolError):
        _after(first, (13, (3,), None))


def test_blocks_go_ahead_where_the_hop_costs_more_than_drafting_them():
    from draft_service.hop import EXPLORE_EVERY, PRIOR_HOLD, HopStats

    hop = HopStats()
    assert hop.hold_rate() == PRIOR_HOLD and not hop.send_ahead()  # nothing measured: no transport to hide
    for _ in range(8):
        hop.observe_propose(0.004, ahead=False)
        hop.observe_transport(0.0003)  # loopback: even the prior's optimistic hold (0.68) pays 2.9 of 4 ms
    assert hop.hold_bound() == pytest.approx(0.25 + 2 * (0.25 * 0.75 / 4) ** 0.5)
    assert not any(hop.send_ahead(rank) for _ in range(2 * EXPLORE_EVERY) for rank in (0, 1))
    for _ in range(16):
        hop.observe_transport(0.006)  # a slower hop: 10 ms saved by a block that holds
    assert not any(hop.send_ahead() for _ in range(EXPLORE_EVERY - 1))  # 0.25 * 10 ms < 4 ms ...
    assert hop.send_ahead() and hop.send_ahead(1)  # ... but 0.68 * 10 > 4: every EXPLORE_EVERY-th chance goes
    for _ in range(32):
        hop.observe_ahead(held=False)  # blocks ahead that never hold: even the optimistic rate stops paying
    assert hop.hold_bound() < 0.5
    assert not any(hop.send_ahead() for _ in range(2 * EXPLORE_EVERY))
    assert hop.send_ahead(1)  # rank 1 is not known yet: explored at its chances
    hop = HopStats()
    hop.observe_propose(0.004, ahead=False)
    for _ in range(64):
        hop.observe_transport(0.040)  # a 20 ms link each way: 0.25 * 40 ms > 4 ms
    assert hop.send_ahead() and hop.send_ahead(1) and not hop.send_ahead(9)  # a hedge of rank 9 is priced at 0.025
    for _ in range(64):
        hop.observe_ahead(held=False)  # ... unless blocks sent ahead never hold
        hop.observe_ahead(held=True, rank=1)  # while the second most likely outcome does
    assert hop.hold_rate() < 0.02 and not hop.send_ahead() and hop.send_ahead(1)
    for _ in range(64):
        hop.observe_ahead(held=True)
        hop.observe_propose(0.030, ahead=True)  # and a proposal ahead that costs more than half the trip
    assert hop.hold_rate() > 0.45 and hop.propose_s == 0.030 and not hop.send_ahead()
    # Where not even a block sure to hold would pay (a proposal ahead dearer than the hop and the
    # proposal it spares), nothing goes, not even to explore.
    near = HopStats()
    near.observe_transport(0.0005)
    near.observe_propose(0.003, ahead=False)
    near.observe_propose(0.006, ahead=True)
    assert not any(near.send_ahead(rank) for rank in (0, 1) for _ in range(2 * EXPLORE_EVERY))
    # --pipeline-ahead always: drafting ahead is free where the draft has its own hardware.
    assert all(HopStats(always=True).send_ahead(rank) for rank in range(3))


def test_a_blocks_outcomes_are_its_likely_path_then_a_rejection_at_each_node_of_it():
    from draft_service.types import Proposal

    chain = Proposal((5, 6, 7))
    assert chain.outcomes() == [((5, 6, 7), None), ((), {5}), ((5,), {6}), ((5, 6), {7})]
    # Root children 10 and 11; 10 has children 12, 13; 12 has 14.
    tree = Proposal((10, 11, 12, 13, 14), parents=(-1, -1, 0, 0, 2))
    assert tree.likely_path() == (10, 12, 14)
    assert tree.outcomes() == [((10, 12, 14), None), ((), {10, 11}), ((10,), {12, 13}), ((10, 12), {14})]
    assert tree.below_first() == Proposal((12, 13, 14), parents=(-1, -1, 0))
    assert Proposal().outcomes() == [((), None)]


@pytest.mark.parametrize("drafter", ["near-weights", "ngram+eagle trees"])
async def test_hedged_blocks_are_lossless(target, near_target, eagle_head, drafter):
    """Three blocks ahead on three outcomes of the block before: at most one holds, the output is
    the target's."""
    from test_draft_eagle import PROMPT as EAGLE_PROMPT
    from test_draft_eagle import EngineVerifier, load_eagle

    from draft_service.proposers.ngram_first import NgramFirstProposer
    from target_service.engine import TargetEngine
    from target_service.session import SessionConfig

    n = 40
    if drafter == "near-weights":
        proposer = HfProposer(near_target)
    else:
        proposer = NgramFirstProposer(NgramProposer(), load_eagle(eagle_head, target), tree_nodes=5, measure_shapes=False)
    engine = TargetEngine(target)
    first = engine.prefill("s", EAGLE_PROMPT, SessionConfig(max_new_tokens=n, return_hidden_states=True))
    committed = (*EAGLE_PROMPT, first.token_id)
    spec = SessionSpec("s", committed, len(EAGLE_PROMPT), SamplingParams(), 3, session_max_new_tokens=n)
    verifier = EngineVerifier(engine)
    loop = PipelinedLoop(spec, proposer.new_session(committed, SamplingParams()), verifier, run_inline, depth=2,
                         hedges=3, want_hidden_states=proposer.wants_hidden_states)
    results = await collect(loop)
    assert [first.token_id, *streamed(results)] == generate_greedy(target.model, EAGLE_PROMPT, n,
                                                                   target.tokenizer.eos_token_id)
    # Blocks sent on the same assumption base: hedges, their assumptions distinct.
    by_parent: dict[tuple, list] = {}
    for block in verifier.blocks:
        if block.assumed_token_ids:
            by_parent.setdefault(block.base_len, []).append(block.assumed_token_ids)
    assert any(len(set(a)) == len(a) > 1 for a in by_parent.values())
    assert loop.stale_blocks > 0
    if drafter == "near-weights":  # a random head guesses no target token; a nearby model does
        assert loop.held_blocks > 0
    # Every block ahead judged, but those still in flight when the session finished (unread).
    sent_ahead = sum(1 for b in verifier.blocks if b.assumed_token_ids)
    assert sent_ahead - 3 <= loop.held_blocks + loop.stale_blocks <= sent_ahead


async def test_a_draft_killed_with_blocks_in_flight_loses_nothing(target, monkeypatch):
    """The draft dies while blocks are in flight: the target commits what it verified, whoever
    listens, and stays consistent; the gateway's resync (a fresh session on the prompt and the
    streamed tokens, decoded by the target) gives the target's output exactly."""
    import grpc
    from test_draft_e2e import PROMPT as E2E_PROMPT
    from test_draft_e2e import prefill

    from draft_service.hop import HopStats
    from draft_service.main import start_draft
    from tandem.v1 import draft_pb2_grpc
    from target_service.engine import TargetEngine
    from target_service.errors import SessionNotFound
    from target_service.main import start_target
    from target_service.session import SessionConfig

    monkeypatch.setattr(HopStats, "send_ahead", lambda self, rank=0: True)
    n = 40
    expected = generate_greedy(target.model, E2E_PROMPT, n, target.tokenizer.eos_token_id)
    engine = TargetEngine(target)
    served = await start_target(engine)
    address = f"127.0.0.1:{served.port}"
    drafting = await start_draft(lambda info: HfProposer(target), address, num_speculative_tokens=2,
                                 target_wait_s=10, pipeline_depth=3)
    try:
        request = await prefill(address, target, "doomed", n)
        streamed_ids = [request.token_ids[-1]]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{drafting.port}") as channel:
            async for reply in draft_pb2_grpc.DraftServiceStub(channel).Speculate(request):
                streamed_ids += reply.token_ids
                if len(streamed_ids) >= 6:
                    await drafting.stop(0)  # killed mid-stream, blocks in flight
                    break
        # The target's session (unless the dying draft released it): consistent, and holding at
        # least what was streamed.
        try:
            committed = list(engine.store.get("doomed").tokens[len(E2E_PROMPT):])
        except SessionNotFound:
            committed = streamed_ids
        assert committed[: len(streamed_ids)] == streamed_ids and committed == expected[: len(committed)]
        # The gateway's resync: a fresh target session on what the client has, decoded by the target.
        engine.prefill("resync", [*E2E_PROMPT, *streamed_ids[:-1]], SessionConfig(max_new_tokens=n - len(streamed_ids) + 1))
        engine.generate("resync", n)
        rest = list(engine.store.get("resync").tokens[len(E2E_PROMPT) + len(streamed_ids) - 1:])
        assert [*streamed_ids[:-1], *rest] == expected
    finally:
        await drafting.stop(0)
        await served.stop(0)


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
async def test_the_loop_measures_the_hop_and_teaches_the_block_length_policy(target, pipelined, monkeypatch):
    """Every verdict that reports the target's pass gives the hop a round trip (what the block
    went through beyond the pass), which the block-length policy then prices rounds with; and every
    verified block with named drafts teaches the policy its acceptance and the cost of its width,
    in the pipelined loop (the default) as in the synchronous one. A block sent while another was
    in flight teaches its pass only: its wait includes the other's."""
    from test_draft_eagle import PROMPT as EAGLE_PROMPT
    from test_draft_eagle import EngineVerifier

    from draft_service.block_length import BlockLengthPolicy
    from draft_service.hop import HopStats
    from draft_service.loop import SpeculationLoop
    from target_service.engine import TargetEngine
    from target_service.session import SessionConfig

    engine = TargetEngine(target)
    first = engine.prefill("s", EAGLE_PROMPT, SessionConfig(max_new_tokens=24))
    committed = (*EAGLE_PROMPT, first.token_id)
    spec = SessionSpec("s", committed, len(EAGLE_PROMPT), SamplingParams(), 3, session_max_new_tokens=24)
    hop, lengths = HopStats(), BlockLengthPolicy(explore_every=0)
    priced = []
    length = lengths.length
    lengths.length = lambda sources, session=None, transport_s=None, parents=(): priced.append(transport_s) or length(
        sources, session, transport_s, parents)
    # The target's own weights draft: every assumption holds, so blocks go out ahead and are verified.
    session = HfProposer(target).new_session(committed, SamplingParams())
    if pipelined:
        monkeypatch.setattr(HopStats, "send_ahead", lambda self, rank=0: True)
        loop = PipelinedLoop(spec, session, EngineVerifier(engine), run_inline, lengths=lengths, hop=hop, depth=2)
    else:
        loop = SpeculationLoop(spec, session, EngineVerifier(engine), run_inline, lengths=lengths, hop=hop)
    results = await collect(loop)
    assert hop.measured_transport_s is not None and 0 <= hop.measured_transport_s < 1.0
    assert any(t is not None for t in priced)  # blocks after the first were priced with the hop
    judged = [r for r in results if r.verified and r.num_draft_tokens]
    assert judged and lengths.acceptance.offered >= len(judged)
    passes = sum(len(samples) for samples in lengths.costs._samples.values())
    assert passes == len(judged)  # every verified block's pass, by its width
    if pipelined:
        assert loop.held_blocks > 0 and len(lengths._transport_seconds) <= passes - loop.held_blocks
    else:
        assert len(lengths._transport_seconds) == passes


async def test_sessions_pipelined_across_a_slow_hop_are_lossless_and_interleave_on_the_target(target):
    """Three sessions at once through a draft whose hop to the target is 20 ms each way (the
    bench's delaying proxy): the measured hop makes the draft send blocks ahead; the target takes
    the sessions' blocks interleaved on their streams; each output is the target's. The hop is long
    enough that blocks ahead pay even when a busy host makes proposing them cost milliseconds (at
    5 ms a way, a proposal ahead timed at 4.9 ms on a loaded 2-core host outweighed the saving)."""
    import asyncio

    import grpc
    from test_draft_e2e import PROMPT as E2E_PROMPT
    from test_draft_e2e import prefill

    from draft_service.main import start_draft
    from tandem.tools.bench.delay_proxy import DelayProxy
    from tandem.v1 import draft_pb2_grpc
    from target_service.engine import TargetEngine
    from target_service.main import start_target

    n = 32
    served = await start_target(TargetEngine(target))
    proxy = await DelayProxy(f"127.0.0.1:{served.port}", delay_s=0.02).start()
    # Prompt lookup: its proposals cost next to nothing beside a 40 ms round trip, so they pay.
    drafting = await start_draft(lambda info: NgramProposer(), proxy.address, num_speculative_tokens=3,
                                 target_wait_s=10, pipeline_depth=2, pipeline_hedges=3)
    try:
        async def session(name: str) -> list[int]:
            request = await prefill(f"127.0.0.1:{served.port}", target, name, n)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{drafting.port}") as channel:
                replies = [r async for r in draft_pb2_grpc.DraftServiceStub(channel).Speculate(request)]
            return [request.token_ids[-1], *(t for r in replies for t in r.token_ids)]

        outputs = await asyncio.gather(*(session(name) for name in ("a", "b", "c")))
        expected = generate_greedy(target.model, E2E_PROMPT, n, target.tokenizer.eos_token_id)
        assert outputs == [expected] * 3
        metric = drafting.engine._metrics.pipelined_blocks
        held, stale = (metric.labels(outcome=o)._value.get() for o in ("verified", "stale"))
        hop = next(iter(drafting.engine._hops.values()))
        # Blocks went ahead over the slow hop, more than exploring alone sends (1 chance in 16).
        assert held + stale >= 3, (held, stale, hop.transport_s, hop.propose_s)
        assert hop.transport_s >= 0.010  # the round trip beyond the target's pass: both ways of the hop
    finally:
        await drafting.stop(0)
        await proxy.stop()
        await served.stop(0)


def test_proposers_name_their_next_tokens_most_likely_first(target, near_target, eagle_head, monkeypatch):
    """What a hedge guesses the target's token with: the proposer's top tokens after the committed
    sequence (the first being what it would draft), at no state change a proposal would not make."""
    from test_draft_eagle import load_eagle

    hf = HfProposer(near_target).new_session(PROMPT, SamplingParams())
    top = hf.next_tokens(3)
    assert len(top) == 3 == len(set(top)) and hf.propose(2).token_ids[0] == top[0]
    hf.commit(len(PROMPT), (top[1],))  # a hedge takes the second as committed and drafts on
    assert hf.next_tokens(1) == HfProposer(near_target).new_session((*PROMPT, top[1]), SamplingParams()).next_tokens(1)

    eagle = load_eagle(eagle_head, target)
    session = eagle.new_session(PROMPT, SamplingParams())
    assert session.next_tokens(2) == ()  # no feature yet
    session.commit(len(PROMPT), (11, 12), torch.randn(2, eagle.drafter.config.hidden_size))
    guesses = session.next_tokens(2)
    assert len(guesses) == 2 and session.propose(1).token_ids == guesses[:1]
    steps = []
    step = eagle.drafter.step
    monkeypatch.setattr(eagle.drafter, "step", lambda *a: steps.append(1) or step(*a))
    session.next_tokens(2)
    session.commit(len(PROMPT) + 2, (guesses[1],), None)  # taking a named token costs no step
    assert session.has_feature and steps == []
    assert NgramProposer().new_session((1, 2, 3, 1, 2), SamplingParams()).next_tokens(3) == (3,)
