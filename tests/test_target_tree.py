"""Token-tree blocks in the target: greedy losslessness whatever the tree, the accepted path's cache
and hidden states, budgets, refusals, and the tree helpers (``target_service.tree``), on tiny random
Llama and Gemma 3 (sliding window 8) targets and over gRPC's conversion."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.models import load_model
from tandem.v1 import target_pb2
from target_service import tree, wire
from target_service.types import DraftBlock, SparseDist, VerdictStatus
from target_service.engine import TargetEngine
from target_service.errors import InvalidArgument
from test_target_engine import NEW_TOKENS, PROMPT_LEN, greedy, hf_greedy
from test_target_engine import _prompt as prompt_ids


def random_tree(rng: random.Random, reference: list[int], nodes: int) -> tuple[list[int], list[int]]:
    """A tree of ``nodes`` drafts mixing the target's own continuation (so some paths are
    accepted deep) with random siblings; siblings have distinct tokens."""
    tokens: list[int] = []
    parents: list[int] = []
    depth_of: list[int] = []
    for i in range(nodes):
        parent = rng.choice([tree.ROOT, *range(i)])
        depth = 0 if parent == tree.ROOT else depth_of[parent]
        token = reference[depth] if depth < len(reference) and rng.random() < 0.6 else rng.randrange(300)
        if any(p == parent and t == token for p, t in zip(parents, tokens)):
            token = (token + 1 + rng.randrange(299)) % 300
            if any(p == parent and t == token for p, t in zip(parents, tokens)):
                continue
        tokens.append(token)
        parents.append(parent)
        depth_of.append(depth + 1)
    return tokens, parents


def on_path(tokens: list[int], parents: list[int], accepted: list[int]) -> bool:
    node = tree.ROOT
    for token in accepted:
        children = [i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token]
        if not children:
            return False
        node = children[0]
    return True


@pytest.mark.parametrize("screened", [False, True])
def test_tree_blocks_decode_exactly_the_target_greedy_output(llama_or_gemma, screened) -> None:
    """Random trees over a whole session: every verdict's accepted tokens are a root path of its
    tree, the cache keeps the engine's invariant, and the output is transformers' greedy decoding."""
    engine = TargetEngine(llama_or_gemma)
    if screened:  # the screened head's argmax path (the tiny head is below its size threshold otherwise)
        from tandem.cpu.screened_head import ScreenedArgmax

        engine.runner.greedy_head = ScreenedArgmax(llama_or_gemma.model.get_output_embeddings().weight.detach())
    prompt = prompt_ids(0)
    reference = hf_greedy(llama_or_gemma.model, prompt, NEW_TOKENS)
    engine.prefill("s", prompt, greedy())
    session = engine.store.get("s")
    rng = random.Random(1)
    block_id = 0
    deepest = 0
    while not session.finished:
        block_id += 1
        before = session.committed_len
        done = before - PROMPT_LEN
        tokens, parents = random_tree(rng, reference[done:], rng.randint(1, 8))
        verdict = engine.verify(DraftBlock("s", before, tuple(tokens), block_id=block_id, draft_parents=tuple(parents)))
        assert verdict.status == VerdictStatus.OK
        accepted = list(verdict.committed_token_ids[: verdict.num_accepted])
        assert on_path(tokens, parents, accepted)
        deepest = max(deepest, verdict.num_accepted)
        if not session.finished:
            assert len(verdict.committed_token_ids) == verdict.num_accepted + 1
            assert session.cache.get_seq_length() == session.committed_len - 1
    assert session.tokens[PROMPT_LEN:] == reference
    assert deepest >= 2  # some paths were accepted past their first node


def test_the_accepted_path_leaves_the_cache_and_hidden_states_of_a_chain(llama_or_gemma) -> None:
    """After a tree verdict whose path skips nodes, the cache holds exactly the committed tokens'
    keys and values: the next pass gives the logits of a fresh pass over the sequence, and the
    verdict's hidden states are the fresh pass's states for the committed positions."""
    engine = TargetEngine(llama_or_gemma)
    prompt = prompt_ids(3)
    reference = hf_greedy(llama_or_gemma.model, prompt, 8)
    engine.prefill("s", prompt, greedy(return_hidden_states=True))
    wrong = [(reference[1] + 7) % 300, (reference[1] + 8) % 300]
    # root -> wrong0, root -> wrong1, root -> ref1 -> (wrong, ref2 -> ref3)
    tokens = (wrong[0], wrong[1], reference[1], (reference[2] + 5) % 300, reference[2], reference[3])
    parents = (-1, -1, -1, 2, 2, 4)
    verdict = engine.verify(DraftBlock("s", PROMPT_LEN + 1, tokens, draft_parents=parents))
    assert verdict.num_accepted == 3 and list(verdict.committed_token_ids) == reference[1:5]
    session = engine.store.get("s")
    sequence = prompt + reference[:5]
    assert session.tokens == sequence and session.cache.get_seq_length() == len(sequence) - 1
    with torch.inference_mode():
        fresh = llama_or_gemma.model(torch.tensor([sequence]), output_hidden_states=True)
    states = fresh.hidden_states[-1][0]  # [len(sequence), hidden]
    torch.testing.assert_close(verdict.hidden_states, states[PROMPT_LEN : PROMPT_LEN + 4], atol=1e-4, rtol=1e-4)
    chain = engine.verify(DraftBlock("s", len(sequence), (), block_id=1))  # one more row over the compacted cache
    assert chain.committed_token_ids == (reference[5],)


def test_a_tree_deeper_than_the_budget_commits_within_it(llama) -> None:
    engine = TargetEngine(llama)
    prompt = prompt_ids(5)
    reference = hf_greedy(llama.model, prompt, 3)
    engine.prefill("s", prompt, greedy(max_new_tokens=3))
    tokens = (reference[1], reference[2], 11, 12)
    verdict = engine.verify(DraftBlock("s", PROMPT_LEN + 1, tokens, draft_parents=(-1, 0, 1, 2)))
    assert verdict.committed_token_ids == tuple(reference[1:3]) and engine.store.get("s").finished


def test_tree_refusals(llama) -> None:
    engine = TargetEngine(llama)
    engine.prefill("g", prompt_ids(6), greedy())
    engine.prefill("t", prompt_ids(7), greedy(temperature=1.0, seed=1))
    bad_sampled = {"no draft_probs": DraftBlock("t", PROMPT_LEN + 1, (1,), draft_probs=(SparseDist((1,), (1.0,)),),
                                                draft_parents=(-1,))}
    bad = {
        "entries for": DraftBlock("g", PROMPT_LEN + 1, (1, 2), draft_parents=(-1,)),
        "earlier draft": DraftBlock("g", PROMPT_LEN + 1, (1, 2), draft_parents=(-1, 1)),
        "appears twice": DraftBlock("g", PROMPT_LEN + 1, (1, 1), draft_parents=(-1, -1)),
        "no draft_probs": DraftBlock(
            "g", PROMPT_LEN + 1, (1,), draft_probs=(SparseDist((1,), (1.0,)),), draft_parents=(-1,)
        ),
    }
    for message, block in [*bad.items(), *bad_sampled.items()]:
        with pytest.raises(InvalidArgument, match=message):
            engine.verify(block)
    for session_id in ("g", "t"):  # refused blocks changed nothing
        session = engine.store.get(session_id)
        assert session.committed_len == PROMPT_LEN + 1 and session.cache.get_seq_length() == PROMPT_LEN


def test_the_tree_travels_through_the_wire_conversion() -> None:
    request = target_pb2.VerifyRequest(session_id="s", base_len=3, draft_token_ids=[5, 6, 7], draft_parents=[-1, 0, -1])
    assert wire.draft_block(request).draft_parents == (-1, 0, -1)
    assert wire.draft_block(target_pb2.VerifyRequest(session_id="s", base_len=3)).draft_parents == ()


def test_tree_helpers() -> None:
    assert tree.forward_parents([-1, 0, -1, 2]) == (-1, 0, 1, 0, 3)
    assert tree.depths([-1, 0, -1, 2, 3]) == [1, 2, 1, 2, 3]
    assert tree.within_depth([5, 6, 7, 8, 9], [-1, 0, -1, 2, 3], 2) == ([5, 6, 7, 8], [-1, 0, -1, 2])
    # choices by row [root, d0, d1, d2]: root -> 7 (d1) -> 9 (no such child of d1): path [1], next 9
    assert tree.greedy_path([5, 7, 8], [-1, -1, 1], [7, 0, 9, 0]) == ([1], 9)
    assert tree.greedy_path([5, 7, 8], [-1, -1, 1], [7, 0, 8, 4]) == ([1, 2], 4)
    assert tree.greedy_path([5], [-1], [3, 0]) == ([], 3)


def test_a_walk_asks_for_the_rows_on_its_path_only_in_order() -> None:
    """A sampled walk draws at each row it reaches, root first, and at no other row."""
    asked: list[int] = []
    answers = {0: 7, 2: 8, 3: 4}  # root -> 7 (d1), d1 -> 8 (d2), d2 -> 4: no such child

    def choose(row: int) -> int:
        asked.append(row)
        return answers[row]

    assert tree.walk([5, 7, 8, 6], [-1, -1, 1, 0], choose) == ([1, 2], 4)
    assert asked == [0, 2, 3]


def test_sampled_tree_blocks_commit_a_root_path_and_a_seeded_session_repeats_itself(llama) -> None:
    """Trees for a sampled session (the distribution: ``test_target_sampling``): each verdict
    accepts a root path of its tree, and the same seed and blocks give the same tokens."""
    prompt = prompt_ids(5)
    runs, accepted = [], 0
    for _ in range(2):
        engine = TargetEngine(llama)
        engine.prefill("s", prompt, greedy(temperature=0.02, seed=3, max_new_tokens=16))
        session = engine.store.get("s")
        rng = random.Random(9)
        while not session.finished:
            likely = hf_greedy(llama.model, session.tokens, 6)  # guesses the target often draws at T=0.02
            tokens, parents = random_tree(rng, likely, 6)
            verdict = engine.verify(DraftBlock("s", session.committed_len, tuple(tokens), draft_parents=tuple(parents)))
            assert verdict.status == VerdictStatus.OK
            assert on_path(tokens, parents, list(verdict.committed_token_ids[: verdict.num_accepted]))
            accepted += verdict.num_accepted
        runs.append(session.tokens)
    assert runs[0] == runs[1] and accepted > 0


def test_trees_through_tandem_tree_attention(tiny_gemma_dir) -> None:
    """The CUDA engine's attention (tandem's tree attention, which builds its own masks; here its
    PyTorch reference) reads the tree from ``tree_forward`` inside the ragged pass."""
    from kernels import hf_attention

    loaded = load_model(str(tiny_gemma_dir), device="cpu", dtype="float32")
    hf_attention.install(loaded.model, hf_attention.NAME_REFERENCE)
    engine = TargetEngine(loaded)
    assert engine.runner.attention.endswith(hf_attention.NAME_REFERENCE)
    prompt = prompt_ids(9)
    reference = hf_greedy(loaded.model, prompt, 12)
    engine.prefill("s", prompt, greedy(max_new_tokens=12))
    session = engine.store.get("s")
    rng = random.Random(4)
    while not session.finished:
        tokens, parents = random_tree(rng, reference[session.committed_len - PROMPT_LEN :], 6)
        engine.verify(DraftBlock("s", session.committed_len, tuple(tokens), draft_parents=tuple(parents)))
    assert session.tokens[PROMPT_LEN:] == reference
