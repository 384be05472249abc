"""Token trees on the draft side: ``TokenTree`` in ngram+eagle, and the loop's handling of tree blocks.

The builder is checked against a scripted head (exact probabilities, so the best-first order is
known) and, through ``NgramFirstSession``, against a tiny random head for the wiring and the
fallbacks to chains. The loop is driven by scripted verdicts.
"""

from __future__ import annotations

import pytest
import torch
from test_draft_eagle import load_eagle, target_info
from draft_fakes import InMemoryVerifier, ReferenceTarget, generate_greedy

from draft_service.block_length import BlockLengthPolicy, confidence_source
from draft_service.block_shape import CHAIN as BLOCK_CHAIN
from draft_service.block_shape import TREE as BLOCK_TREE
from draft_service.errors import ProtocolError
from draft_service.loop import SpeculationLoop, root_path_length
from draft_service.proposers import make_proposer
from draft_service.proposers.eagle import HeadGuesses
from draft_service.proposers.ngram import NgramProposer
from draft_service.proposers.ngram_first import (
    TREE_HEAD_SOURCE,
    TREE_LOOKUP_SOURCE,
    NgramFirstProposer,
    NgramFirstSession,
    TokenTree,
)
from draft_service.types import (
    ProposedBlock,
    FinishReason,
    Proposal,
    SamplingParams,
    SessionSpec,
    Verdict,
    VerdictStatus,
)
from tandem.config import DraftSettings

H, L = TREE_HEAD_SOURCE, TREE_LOOKUP_SOURCE


def head_source(p: float) -> str:
    """A head node's source: the head's probability for it after its parent, in tenths."""
    return confidence_source(H, p)


# --------------------------------------------------------------------------- the builder, scripted


def guesses(*pairs: tuple[int, float]) -> HeadGuesses:
    return HeadGuesses(torch.zeros(1, 4), tuple(t for t, _ in pairs), tuple(p for _, p in pairs))  # feature [1, 4]


class ScriptedHead:
    """The head's guesses after each drafted token, from a table; records which tokens it expanded."""

    def __init__(self, table: dict[int, HeadGuesses]) -> None:
        self.table = table
        self.expanded: list[int] = []
        self.remembered: dict[tuple[int, ...], torch.Tensor] = {}  # a node's root path -> its feature

    def remember(self, drafts: tuple[int, ...], feature: torch.Tensor) -> None:
        self.remembered[drafts] = feature

    def guesses_after(self, features: torch.Tensor, tokens: list[int], k: int) -> list[HeadGuesses]:
        assert features.shape == (len(tokens), 4)  # [b, hidden]: one batched step
        self.expanded.append(tuple(tokens))
        found = [self.table.get(t, guesses((90 + t % 5, 0.5), (95 + t % 5, 0.1))) for t in tokens]
        return [HeadGuesses(g.feature, g.token_ids[:k], g.probs[:k]) for g in found]


ROOT = guesses((10, 0.7), (11, 0.2))
TABLE = {10: guesses((12, 0.8), (13, 0.1)), 11: guesses((14, 0.9), (15, 0.05)), 12: guesses((16, 0.5), (17, 0.3))}


def test_a_strong_lookup_branch_joins_first_and_nearly_as_probable_guesses_expand_in_one_step() -> None:
    head = ScriptedHead(TABLE)
    # Lookup after a 2-token match: 0.9, 0.81, 0.729 by depth, ahead of the head's 0.7 for 10.
    tree = TokenTree(head, top_k=2, budget=5).grow(ROOT, lookup=(10, 12, 20), match_len=2)
    assert tree.token_ids == (10, 12, 20, 11, 14)
    assert tree.parents == (-1, 0, 1, -1, 3)
    assert tree.sources == (L, L, L, head_source(0.2), head_source(0.9))
    # The head's 10 met lookup's node; 11 (0.2, at least a quarter of 0.7) joined before 10's
    # guesses were known, so one step expanded both. 12 (0.56) met lookup's node and 14 (0.18)
    # filled the budget before any step was spent on them.
    assert head.expanded == [(10, 11)]


def test_a_weak_lookup_draft_merges_with_the_heads_equal_guess() -> None:
    head = ScriptedHead(TABLE)
    # After a 1-token match lookup's first draft is worth 0.6: the head's 10 (0.7) joins first,
    # lookup's 10 merges with it, lookup's next draft (0.54) hangs under that node, and the head's
    # 11 (0.2) fills the budget: no head step at all.
    tree = TokenTree(head, top_k=2, budget=3).grow(ROOT, lookup=(10, 99), match_len=1)
    assert tree.token_ids == (10, 99, 11)
    assert tree.parents == (-1, 0, -1)
    assert tree.sources == (head_source(0.7), L, head_source(0.2))
    assert head.expanded == []


def test_without_lookup_the_tree_grows_by_path_probability() -> None:
    head = ScriptedHead(TABLE)
    tree = TokenTree(head, top_k=2, budget=4).grow(ROOT, lookup=(), match_len=0)
    # 10 (0.7) and 11 (0.2) expand in one step; then 12 (0.56) and 14 (0.18).
    assert tree.token_ids == (10, 11, 12, 14) and tree.parents == (-1, -1, 0, 1)
    assert head.expanded == [(10, 11)]
    # A guess under a quarter as probable as the pending node waits for its guesses: 11 (0.2 <
    # 0.25 * 0.9) comes after 10's first guess 12 (0.72), then joins beside it in 12's batch.
    head = ScriptedHead(TABLE)
    sure = TokenTree(head, top_k=2, budget=3).grow(guesses((10, 0.9), (11, 0.2)), (), 0)
    assert sure.token_ids == (10, 12, 11) and sure.parents == (-1, 0, -1) and head.expanded == [(10,)]
    chain = TokenTree(ScriptedHead(TABLE), top_k=1, budget=4).grow(guesses((10, 0.7)), (), 0)  # top-1: a chain
    assert chain.token_ids == (10, 12, 16, 91) and chain.parents == (-1, 0, 1, 2)


# --------------------------------------------------------------------------- through ngram+eagle, tiny head


@pytest.fixture(scope="module")
def eagle(llama, head):
    return load_eagle(head, llama)


def with_feature(proposer: NgramFirstProposer, tokens: list[int], sampling: SamplingParams = SamplingParams()):
    """A session whose head has the feature for the last of ``tokens`` (as after a verdict)."""
    session = proposer.new_session(tokens[:-1], sampling)
    hidden = torch.randn(1, proposer.eagle.drafter.config.hidden_size, generator=torch.Generator().manual_seed(0))
    session.commit(len(tokens) - 1, tokens[-1:], hidden)  # [1, hidden]
    return session


def children(tree: Proposal, parent: int) -> list[int]:
    return [t for t, p in zip(tree.token_ids, tree.parents, strict=True) if p == parent]


def test_a_greedy_session_drafts_a_valid_tree_within_its_budget(eagle) -> None:
    proposer = NgramFirstProposer(NgramProposer(), eagle, tree_nodes=5, tree_top_k=3, measure_shapes=False)
    tokens = [5, 6, 7, 8, 9]  # nothing recurs: the head alone
    for max_tokens, nodes in ((7, 5), (3, 3), (1, 1)):
        session = with_feature(proposer, tokens)
        tree = session.propose(max_tokens)  # Proposal checks parents precede children
        assert len(tree.token_ids) == len(tree.parents) == nodes and session.trees == 1
        assert tree.parents[0] == -1 and all(source.startswith(f"{H}:") for source in tree.sources)
        for parent in range(-1, nodes):
            assert len(set(children(tree, parent))) == len(children(tree, parent)) <= 3  # distinct siblings
    # A random head spreads its probability thin: two nodes are its two best first guesses.
    session = with_feature(NgramFirstProposer(NgramProposer(), eagle, tree_nodes=2, measure_shapes=False), tokens)
    assert session.propose(7).token_ids == session._eagle.guesses(2).token_ids


class ScriptedSession(ScriptedHead):
    """An eagle session for ``NgramFirstSession`` whose first guesses are ``ROOT``."""

    def guesses(self, k: int) -> HeadGuesses:
        return HeadGuesses(ROOT.feature, ROOT.token_ids[:k], ROOT.probs[:k])


def test_propose_puts_a_weak_lookup_copy_in_the_tree_and_sends_a_strong_one_as_a_chain() -> None:
    tokens = [7, 10, 99, 7]  # 7 recurs after one token: lookup copies (10, 99, 7, 10, ...)
    lookup = NgramProposer().new_session(tokens, SamplingParams())
    session = NgramFirstSession(lookup, ScriptedSession(TABLE), tree_nodes=5)
    tree = session.propose(7)
    # The head's 10 (0.7) first, lookup's 10 (0.6) merged into it, then lookup's copy under it
    # (0.54, 0.486, ...), each at least a quarter as probable as 10: no head step was needed.
    assert tree.token_ids == (10, 99, 7, 10, 99)
    assert tree.parents == (-1, 0, 1, 2, 3)
    assert tree.sources == (head_source(0.7), L, L, L, L)
    assert session.trees == 1 and session.lookups == session.head_drafts == 0
    # After a match of two tokens lookup's long copy goes as a chain of the block's K, as without trees.
    strong = NgramFirstSession(
        NgramProposer().new_session([5, 7, 10, 99, 5, 7], SamplingParams()), ScriptedSession(TABLE), tree_nodes=5
    )
    chain = strong.propose(7)
    assert chain.parents == () and chain.token_ids[:3] == (10, 99, 5) and strong.lookups == 1 and strong.trees == 0


def test_an_unsure_head_leaves_the_tree_to_lookups_copy(eagle) -> None:
    proposer = NgramFirstProposer(NgramProposer(), eagle, tree_nodes=6, measure_shapes=False)
    guess = with_feature(proposer, [5, 6, 7])._eagle.guesses(1).token_ids[0]  # after 7: feature and token only
    other = next(t for t in range(20, 99) if t not in (guess, 7))
    # Lookup's weakest draft here (0.6 * 0.9 ** 3) is worth more than anything a random head guesses.
    tree = with_feature(proposer, [7, guess, other, 7]).propose(4)
    assert tree == Proposal((guess, other, 7, guess), sources=(L,) * 4, parents=(-1, 0, 1, 2))


def test_chains_without_a_feature_and_by_default_trees_for_sampled_sessions_too(eagle) -> None:
    tree_proposer = NgramFirstProposer(NgramProposer(), eagle, tree_nodes=5, measure_shapes=False)
    fresh = tree_proposer.new_session([7, 8, 9, 7], SamplingParams())  # no verdict yet: no feature
    assert fresh.propose(3) == Proposal((8, 9, 7), sources=("lookup:1",) * 3)  # lookup's chain, as today
    assert fresh.trees == 0
    assert tree_proposer.new_session([5, 6, 7, 8, 9], SamplingParams()).propose(3) == Proposal()

    sampling = SamplingParams(temperature=1.0, seed=0)
    sampled = with_feature(tree_proposer, [5, 6, 7, 8, 9], sampling).propose(3)
    greedy_tree = with_feature(tree_proposer, [5, 6, 7, 8, 9]).propose(3)
    # The same deterministic guesses, with no q: the target draws its own token at each node.
    assert sampled.parents and not sampled.probs and sampled == greedy_tree
    chain = with_feature(NgramFirstProposer(NgramProposer(), eagle), [5, 6, 7, 8, 9], sampling).propose(3)
    assert chain.parents == () and chain.probs  # a sampled chain carries the head's q

    assert with_feature(NgramFirstProposer(NgramProposer(), eagle), [5, 6, 7, 8, 9]).propose(3).parents == ()
    with pytest.raises(ValueError, match="tree_top_k"):
        NgramFirstProposer(NgramProposer(), eagle, tree_nodes=5, tree_top_k=0, measure_shapes=False)


def test_the_settings_reach_the_proposer(llama, head) -> None:
    settings = DraftSettings(draft_model=f"ngram+{head}", target_model=str(llama.hf_dir), device="cpu")
    made = make_proposer(settings, target_info(llama))
    assert (made.tree_nodes, made.tree_top_k) == (5, 2)  # trees of five nodes by default
    assert made.block_shapes is not None  # trees or chains, as measured
    settings = settings.model_copy(update={"draft_tree_nodes": 6, "draft_tree_top_k": 3, "draft_trees": "always"})
    made = make_proposer(settings, target_info(llama))
    assert (made.tree_nodes, made.tree_top_k) == (6, 3) and made.block_shapes is None


def test_a_measured_session_drafts_the_shape_chosen_and_names_it(eagle) -> None:
    proposer = NgramFirstProposer(NgramProposer(), eagle, tree_nodes=5)  # measured: the default
    shapes = proposer.block_shapes
    tokens = [5, 6, 7, 8, 9]  # nothing recurs: the head alone
    tree = with_feature(proposer, tokens).propose(7)  # nothing measured yet: a tree first
    assert tree.parents and tree.shape == BLOCK_TREE
    shapes.observe(BLOCK_TREE, 2, 0.02)
    chain = with_feature(proposer, tokens).propose(7)  # then a chain, as a proposer without trees drafts it
    assert not chain.parents and chain.token_ids and chain.shape == BLOCK_CHAIN
    assert chain.token_ids == with_feature(NgramFirstProposer(NgramProposer(), eagle), tokens).propose(7).token_ids
    # Where nothing was chosen the block names no shape: no feature yet, or a strong lookup match.
    assert proposer.new_session([7, 8, 9, 7], SamplingParams()).propose(3).shape == ""
    strong = with_feature(proposer, [5, 7, 10, 99, 5, 7]).propose(7)
    assert not strong.parents and strong.token_ids[:3] == (10, 99, 5) and strong.shape == ""
    # A cut chain keeps its shape (the loop reports the round under it).
    assert chain.cut(1).shape == BLOCK_CHAIN
    assert NgramFirstProposer(NgramProposer(), eagle).block_shapes is None  # chains only: nothing to choose
    # Sampled sessions choose apart from greedy ones: their rounds commit at other rates.
    sampled = proposer.shapes_for(SamplingParams(temperature=1.0, seed=0))
    assert sampled is not None and sampled is not shapes and proposer.shapes_for(SamplingParams()) is shapes
    assert with_feature(proposer, tokens, SamplingParams(temperature=1.0, seed=0)).propose(7).shape == BLOCK_TREE


# --------------------------------------------------------------------------- the loop


# 10 and 11 under the last committed token, 12 under 11, 13 under 10.
TREE = Proposal((10, 11, 12, 13), sources=(H, H, H, L), parents=(-1, -1, 1, 0))
BASE = (1, 2, 3)


class FixedDraft:
    """A proposer session that drafts ``TREE`` and records its commits."""

    def __init__(self) -> None:
        self.commits: list[tuple[int, tuple[int, ...]]] = []

    def propose(self, max_tokens: int) -> Proposal:
        return TREE

    def commit(self, base_len, token_ids, hidden_states=None) -> None:
        self.commits.append((base_len, tuple(token_ids)))

    def close(self) -> None:
        pass


class OneVerdict:
    """Answers the first block with ``committed`` (``accepted`` of them drafts) and finishes."""

    def __init__(self, accepted: int, committed: tuple[int, ...]) -> None:
        self.accepted, self.committed = accepted, committed
        self.blocks: list[ProposedBlock] = []

    async def verify(self, block: ProposedBlock) -> Verdict:
        self.blocks.append(block)
        return Verdict(
            block_id=block.block_id,
            status=VerdictStatus.OK,
            num_accepted=self.accepted,
            committed_token_ids=self.committed,
            committed_len=block.base_len + len(self.committed),
            finish_reason=FinishReason.STOP,
        )


class CutTo:
    """A block-length policy that cuts every block to ``nodes`` drafts and records what it learns."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.observed: list[tuple] = []

    def length(self, sources, session=None, transport_s=None, parents=()) -> int:
        return self.nodes

    def observe(self, sources, num_accepted, rows, seconds, propose_seconds, verify_seconds=0.0, parents=(),
                path=(), pass_rows=0, pass_tokens=0, committed=None) -> None:
        self.observed.append((tuple(sources), num_accepted, rows, tuple(parents), tuple(path)))


async def run_inline(fn, *args):
    return fn(*args)


async def one_round(verifier: OneVerdict, lengths: CutTo | None = None):
    spec = SessionSpec("s", BASE, prompt_len=2, sampling=SamplingParams(), num_speculative_tokens=4)
    loop = SpeculationLoop(spec, FixedDraft(), verifier, run_inline, lengths=lengths)
    return [result async for result in loop.rounds()], loop


async def test_the_loop_sends_a_tree_whole_without_a_policy_and_commits_its_accepted_root_path() -> None:
    verifier = OneVerdict(2, (11, 12, 40))
    results, loop = await one_round(verifier)
    assert verifier.blocks[0].proposal == TREE
    assert [r.token_ids for r in results] == [(11, 12, 40)] and results[0].num_accepted == 2
    assert results[0].num_draft_tokens == len(TREE.token_ids) and results[0].num_draft_positions == TREE.positions
    assert loop.pending_commit[:2] == (len(BASE), (11, 12, 40))


async def test_the_policy_cuts_a_tree_to_its_first_nodes_and_learns_its_verdict() -> None:
    """A tree is cut as a chain is (its first nodes are a tree: parents come first), and its verdict
    teaches the policy and the session's tally which nodes were judged and which taken."""
    verifier, lengths = OneVerdict(2, (11, 12, 40)), CutTo(3)
    results, loop = await one_round(verifier, lengths)
    sent = verifier.blocks[0].proposal
    assert sent.token_ids == (10, 11, 12) and sent.parents == (-1, -1, 1) and sent.sources == (H, H, H)
    assert results[0].num_draft_tokens == 3 and results[0].num_accepted == 2
    # Path: 11 (node 1), then 12 (node 2). 10 was judged at the root and not taken.
    assert lengths.observed == [((H, H, H), 2, 4, (-1, -1, 1), (1, 2))]
    assert loop.acceptance.rates(min_offered=1) == {(H, 0): 0.5, (H, 1): 1.0}
    assert TREE.cut(0) == Proposal() and TREE.cut(9) is TREE


def test_a_tally_judges_the_children_of_the_root_and_of_the_accepted_path_only() -> None:
    policy = BlockLengthPolicy(explore_every=0)
    # Nodes: a (root), b (root), c under a, d under b, e under c. Taken: a, then c; e was judged
    # (its parent c was taken) and rejected; d was never judged (b was not taken).
    sources, parents = ("a", "b", "c", "d", "e"), (-1, -1, 0, 1, 2)
    policy.acceptance.observe(sources, 2, parents, path=(0, 2))
    assert policy.acceptance.rates(min_offered=1) == {("a", 0): 1.0, ("b", 0): 0.0, ("c", 1): 1.0, ("e", 2): 0.0}


def test_the_policy_keeps_a_trees_nodes_while_their_chance_pays_for_the_wider_pass(monkeypatch) -> None:
    policy = BlockLengthPolicy(explore_every=0)
    for rows, seconds in ((1, 0.010), (2, 0.010), (3, 0.010), (4, 0.010), (5, 0.012)):
        for _ in range(3):
            policy.costs.observe(rows, seconds)
    monkeypatch.setattr(policy.acceptance, "estimate", lambda source, depth: {"sure": 0.9, "unsure": 0.05}[source])
    # A sure node, its sure child and an unsure sibling of the first: four rows cost what one does,
    # so even the unsure node rides along (1 + 0.9 + 0.81 + 0.05 tokens in 10 ms)...
    assert policy.length(["sure", "sure", "unsure"], parents=(-1, 0, -1)) == 3
    # ...and a fifth row costs 20% more: worth it for a node taken 0.73 of the time (3.49 tokens in
    # 12 ms), not for one under the unsure node (taken 0.0025 of the time).
    assert policy.length(["sure", "sure", "unsure", "sure"], parents=(-1, 0, -1, 1)) == 4
    assert policy.length(["sure", "sure", "unsure", "unsure"], parents=(-1, 0, -1, 2)) == 3
    # A node is worth its path's chance, not its own: an unsure root child's sure child is not kept.
    assert policy.length(["sure", "unsure", "sure"], parents=(-1, -1, 1)) == 3  # 4 rows: free
    assert policy.length(["sure", "sure", "unsure", "sure"], parents=(-1, 0, -1, 2)) == 3


@pytest.mark.parametrize(
    ("accepted", "committed"),
    [
        (2, (10, 12, 40)),  # 12 hangs under 11, not 10
        (1, (12, 40)),  # 12 is not a child of the root
        (2, (11, 10, 40)),  # 10 is 11's sibling
    ],
)
async def test_the_loop_refuses_a_tree_verdict_that_is_not_a_root_path(accepted, committed) -> None:
    with pytest.raises(ProtocolError, match="root path"):
        await one_round(OneVerdict(accepted, committed))


def test_positions_are_a_chains_length_and_a_trees_depth() -> None:
    assert Proposal((5, 6, 7)).positions == 3 and Proposal().positions == 0
    assert Proposal((1, 2, 3, 4, 5), parents=(-1, -1, 0, 0, 2)).positions == 3
    assert Proposal((1, 2), parents=(-1, -1)).positions == 1


def test_root_path_length_walks_trees_and_chains() -> None:
    assert root_path_length(TREE, (10, 13, 99)) == 2
    assert root_path_length(TREE, (11, 12)) == 2
    assert root_path_length(TREE, (11, 13)) == 1
    assert root_path_length(TREE, ()) == 0
    chain = Proposal((5, 6, 7))
    assert [root_path_length(chain, t) for t in ((5, 6, 7, 8), (5, 7), (6,))] == [3, 1, 0]


class RandomTrees:
    """A proposer session that drafts random trees of up to ``nodes`` nodes around the target's
    true continuation: each position holds the right token on a random branch, or not at all."""

    def __init__(self, expected: list[int], committed: int, nodes: int, seed: int) -> None:
        self.expected, self.committed, self.nodes = expected, committed, nodes
        self.rng = torch.Generator().manual_seed(seed)

    def _chance(self, p: float) -> bool:
        return float(torch.rand((), generator=self.rng)) < p

    def propose(self, max_tokens: int) -> Proposal:
        tokens: list[int] = []
        parents: list[int] = []
        frontier = [(-1, 0)]  # (node, offset into the continuation after the committed sequence)
        while frontier and len(tokens) < min(self.nodes, max_tokens):
            node, depth = frontier.pop(int(torch.randint(len(frontier), (), generator=self.rng)))
            truth = self.expected[self.committed + depth] if self.committed + depth < len(self.expected) else 0
            children = {tokens[i] for i, p in enumerate(parents) if p == node}
            for token in (truth if self._chance(0.7) else 1000 + len(tokens), 2000 + len(tokens)):
                if token in children or len(tokens) >= min(self.nodes, max_tokens):
                    continue
                tokens.append(token)
                parents.append(node)
                children.add(token)
                if token == truth or self._chance(0.3):
                    frontier.append((len(tokens) - 1, depth + 1))
        return Proposal(tuple(tokens), parents=tuple(parents))

    def commit(self, base_len, token_ids, hidden_states=None) -> None:
        self.committed = base_len + len(token_ids)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_random_trees_through_the_loop_and_the_reference_target_decode_its_greedy_output(llama, seed) -> None:
    prompt, n = (2, 40, 41, 42, 43, 44, 45), 24
    eos = llama.tokenizer.eos_token_id
    expected = generate_greedy(llama.model, prompt, n, eos)  # [n] the target's own continuation
    reference = ReferenceTarget(llama.model, (eos,))
    first, _ = reference.prefill("s", prompt, max_new_tokens=n)
    committed = (*prompt, first)
    spec = SessionSpec("s", committed, len(prompt), SamplingParams(), num_speculative_tokens=6,
                       session_max_new_tokens=n)
    proposer = RandomTrees([*prompt, *expected], len(committed), nodes=6, seed=seed)
    verifier = InMemoryVerifier(reference)
    results = [r async for r in SpeculationLoop(spec, proposer, verifier, run_inline).rounds()]
    assert [first, *(t for r in results for t in r.token_ids)] == expected
    trees = [b.proposal for b in verifier.blocks if b.proposal.parents]
    assert trees and max(r.num_accepted for r in results) >= 2  # trees were sent, and paths accepted
    sent = {b.block_id: b.proposal for b in verifier.blocks}
    assert all(r.num_draft_positions == p.positions for r, p in zip(results, sent.values()) if r.verified)
