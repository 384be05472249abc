"""The measured choice between token trees and chains (draft_service.block_shape): it alternates
while it learns, then drafts the shape that commits more tokens per second of round, explores the
other, and turns back when the rates do."""

from __future__ import annotations

import pytest

from draft_service.block_shape import CHAIN, TREE, BlockShapes


def feed(shapes: BlockShapes, shape: str, rounds: int, tokens: int, seconds: float) -> None:
    for _ in range(rounds):
        shapes.observe(shape, tokens, seconds)


def test_the_shapes_alternate_until_each_has_its_rounds() -> None:
    shapes = BlockShapes(min_rounds=3)
    chosen = []
    for _ in range(6):
        shape = shapes.choose()
        chosen.append(shape)
        shapes.observe(shape, 2, 0.02)
    assert chosen == [TREE, CHAIN] * 3
    assert shapes.rates() == {TREE: pytest.approx(100.0), CHAIN: pytest.approx(100.0)}
    assert shapes.choose() == TREE  # a tie goes to the tree


@pytest.mark.parametrize("faster", [TREE, CHAIN])
def test_the_faster_shape_drafts_and_the_other_is_explored(faster) -> None:
    slower = CHAIN if faster == TREE else TREE
    shapes = BlockShapes(min_rounds=4, explore_every=4)
    feed(shapes, faster, 4, 3, 0.03)  # 100 tokens/s
    feed(shapes, slower, 4, 3, 0.04)  # 75
    chosen = [shapes.choose() for _ in range(8)]
    assert chosen == [faster, faster, faster, slower] * 2


def test_rates_are_tokens_over_seconds_of_the_last_window_and_turn_the_choice_back() -> None:
    shapes = BlockShapes(window=4, min_rounds=2, explore_every=0)
    feed(shapes, TREE, 4, 4, 0.04)  # 100 tokens/s
    feed(shapes, CHAIN, 2, 1, 0.02)
    feed(shapes, CHAIN, 2, 5, 0.02)  # 6 / 0.04 = 150
    assert shapes.rates()[CHAIN] == pytest.approx(150.0)
    assert shapes.choose() == CHAIN and shapes.choose() == CHAIN  # no exploration
    feed(shapes, CHAIN, 4, 1, 0.02)  # the window holds these four only: 50
    assert shapes.rates()[CHAIN] == pytest.approx(50.0)
    assert shapes.choose() == TREE


def test_the_lead_changes_only_for_a_clear_margin() -> None:
    shapes = BlockShapes(window=8, min_rounds=2, explore_every=0)
    feed(shapes, TREE, 2, 2, 0.02)  # 100 tokens/s
    feed(shapes, CHAIN, 2, 2, 0.0202)  # 99
    assert shapes.choose() == TREE
    feed(shapes, CHAIN, 4, 2, 0.0196)  # 6 rounds: 12 / 0.1188 = 101: within the margin
    assert shapes.rates()[CHAIN] > shapes.rates()[TREE] and shapes.choose() == TREE
    feed(shapes, CHAIN, 8, 2, 0.0190)  # 105: past it
    assert shapes.choose() == CHAIN


def test_what_cannot_be_a_round_is_refused_or_ignored() -> None:
    shapes = BlockShapes()
    with pytest.raises(ValueError, match="unknown block shape"):
        shapes.observe("bush", 2, 0.01)
    shapes.observe(TREE, 2, 0.0)  # no time: nothing to learn
    assert shapes.rates() == {TREE: None, CHAIN: None}
    with pytest.raises(ValueError):
        BlockShapes(window=0)


async def test_the_draft_service_at_its_default_depth_chooses_shapes_and_cuts_chains(llama, head):
    """The draft service as ``tandem draft`` runs it (pipeline depth 2, cut blocks, ngram+eagle with
    measured trees) in front of the real target service: greedy output is the target's, both shapes
    go out while the choice learns, verified rounds reach its tallies, and the block-length policy
    learns pass costs from the pipelined loop."""
    import grpc
    from draft_fakes import generate_greedy
    from test_draft_eagle import PROMPT

    from draft_service.main import start_draft
    from draft_service.proposers.eagle import EagleProposer
    from draft_service.proposers.ngram import NgramProposer
    from draft_service.proposers.ngram_first import NgramFirstProposer
    from tandem.models import tokenizer_fingerprint
    from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
    from target_service.engine import TargetEngine
    from target_service.main import start_target

    n = 40
    made = []

    def proposer(info):
        made.append(NgramFirstProposer(NgramProposer(), EagleProposer.load(head, llama.hf_dir, info), tree_nodes=5))
        return made[-1]

    target = await start_target(TargetEngine(llama))
    address = f"127.0.0.1:{target.port}"
    try:
        draft = await start_draft(proposer, address, num_speculative_tokens=4, target_wait_s=10, pipeline_depth=2)
        try:
            fingerprint = tokenizer_fingerprint(llama.tokenizer)
            params = common_pb2.SessionParams(max_new_tokens=n)
            async with grpc.aio.insecure_channel(address) as channel:
                first = await target_pb2_grpc.TargetServiceStub(channel).Prefill(target_pb2.PrefillRequest(
                    session_id="shapes", prompt_token_ids=PROMPT, params=params, tokenizer_fingerprint=fingerprint))
            request = draft_pb2.SpeculateRequest(session_id="shapes", token_ids=[*PROMPT, first.token_id],
                                                 prompt_len=len(PROMPT), params=params, tokenizer_fingerprint=fingerprint)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{draft.port}") as channel:
                responses = [r async for r in draft_pb2_grpc.DraftServiceStub(channel).Speculate(request)]
            lengths = draft.engine.block_lengths
        finally:
            await draft.stop(0)
    finally:
        await target.stop(0)
    tokens = [first.token_id, *(t for r in responses for t in r.token_ids)]
    assert tokens == generate_greedy(llama.model, PROMPT, n, llama.tokenizer.eos_token_id)
    tallies = made[-1].block_shapes._tallies
    assert all(len(tally.rounds) > 0 for tally in tallies.values())  # both shapes drafted and reported
    assert lengths is not None and sum(len(s) for s in lengths.costs._samples.values()) > 0
