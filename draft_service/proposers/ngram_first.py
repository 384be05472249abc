"""Prompt lookup first, the eagle head where lookup finds nothing (``ngram+eagle``).

The two drafters fail in different places. Prompt lookup is free and long-sighted where the
output repeats its context (JSON keys, code identifiers, quoted text) but has no draft at all
elsewhere, and then the round is a plain decode step. The eagle head drafts anywhere, at a few
milliseconds a step and with shorter accepted runs. So each round asks lookup first and falls
back to the head when lookup has no match, or only a weak one the head confidently disagrees with
(``_head_overrules``). It is the default draft for a target tandem ships a head for, faster than
lookup alone (figures: docs/drafting.md#default-draft).

Both sub-sessions see every commit, so the head always has the current feature: every block asks
for hidden states, whoever drafted it. Which drafter runs is decided from the committed tokens
only, and each block carries the q of the drafter that made it (one-hot for lookup, the head's
sparse q when sampling), so rejection sampling stays exact.

The head drafts at most ``head_k`` tokens a block (``--eagle-k``, default 3), fewer than lookup's
K (default 7), and stops early where it doubts its own draft (``--eagle-min-confidence``, default
0.5). Its deeper drafts are accepted less often, so past a few of them a draft no longer pays for
its step, even though passes over up to 8 tokens cost little more than one (``tandem.cpu.linear``;
figures: docs/drafting.md#eagle-k).

Greedy sessions may draft a token tree instead where lookup has no strong match (``TokenTree``,
``--draft-tree-nodes N``, default 5; 0 = chains): the head's top guesses at each position and
lookup's weak copy compete for N nodes by estimated path probability, so where the head's first
guess is wrong its second may still be accepted. Whether a tree or a chain pays more on this host
is measured as the service serves (``draft_service.block_shape``; ``--draft-trees always``: trees
wherever they can be drafted).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from draft_service.block_length import AcceptancePrior, confidence_source
from draft_service.block_shape import CHAIN, BlockShapes
from draft_service.proposers.base import Proposer, ProposerSession
from draft_service.proposers.eagle import EagleProposer, EagleSession, HeadGuesses
from draft_service.proposers.ngram import LOOKUP_SOURCE, NgramProposer, NgramSession
from draft_service.types import LogitShaping, Proposal, SamplingParams, SparseDist

COPY_SOURCE = "copy"  # Proposal.sources: lookup's continuation of the head's drafts
# Proposal.sources of a tree's nodes: a head guess by the probability the head gave it after its
# parent (``tree:head:0.7``), lookup's copy as one source; the block-length policy learns how often
# each is taken, apart from a chain's drafts.
TREE_HEAD_SOURCE = "tree:head"
TREE_LOOKUP_SOURCE = "tree:lookup"
# Lookup's drafts have no probability of their own; in a tree they are priced as if each were
# accepted with this probability after a match of two tokens or more (draft d: 0.9 ** (d + 1)),
# and a first draft after a one-token match with WEAK_MATCH_PROBABILITY (then 0.9 a draft more).
LOOKUP_PROBABILITY = 0.9
WEAK_MATCH_PROBABILITY = 0.6
EXPAND_BATCH = 2  # tree nodes whose head guesses one batched head step computes ...
BATCH_SHARE = 0.25  # ... when the later ones are at least this share as probable as the first


@dataclass(order=True)
class _Candidate:
    """A frontier node of a tree being grown: a draft that may join the tree under ``parent``."""

    neg_probability: float  # minus its estimated path probability: heapq pops the most probable
    order: int  # ties go to the earlier candidate
    parent: int = field(compare=False)  # a tree node, or -1 for the last committed token
    token: int = field(compare=False)
    feature: torch.Tensor | None = field(compare=False)  # [1, hidden] to expand a head guess with; None: lookup's
    lookup_depth: int = field(default=-1, compare=False)  # lookup's d-th draft; -1: a head guess
    confidence: float = field(default=0.0, compare=False)  # a head guess's probability given its parent


class TokenTree:
    """A token tree grown best-first by estimated path probability (greedy sessions only).

    A chain spends every extra draft on one guess being right at every depth; a tree spends some
    on the head's second choices near the root, where most rounds end. The frontier starts with
    the head's top-k guesses after the last committed token (probability p each) and lookup's first
    draft; the most probable candidate joins the tree, and a head guess that joins is expanded by
    one head step into its own top-k guesses (path probability times p). Lookup's copy joins as a
    branch of the same frontier, one draft after another. Siblings have distinct tokens (the
    target refuses duplicates): a candidate equal to a node already there merges with it, so a
    lookup draft the head also guessed costs no node, and a head guess equal to a lookup node
    expands that node. Where prompt lookup matches strongly (two tokens or more) the session sends
    lookup's chain instead: a long copy beats any five nodes. Trees commit more tokens a round than
    chains for a little more drafting (``benchmarks/draft_replay.py``; figures:
    docs/drafting.md#tree-nodes).
    """

    def __init__(self, head: EagleSession, top_k: int, budget: int) -> None:
        self._head = head
        self._top_k = top_k
        self._budget = budget  # most nodes
        self._tokens: list[int] = []
        self._parents: list[int] = []
        self._sources: list[str] = []
        self._paths: list[tuple[int, ...]] = []  # each node's drafts from the root, itself included
        self._nodes: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        self._expanded: set[int] = set()  # nodes whose head guesses are in the frontier
        self._frontier: list[_Candidate] = []
        self._order = itertools.count()

    def grow(self, root: HeadGuesses, lookup: Sequence[int], match_len: int) -> Proposal:
        """The tree: ``root`` is the head's guesses after the last committed token, ``lookup`` the
        drafts prompt lookup copies after a suffix match of ``match_len`` tokens (may be empty).

        Candidates join ``EXPAND_BATCH`` at a time and the head guesses among them are expanded in
        one batched step: a tree of five nodes then costs the head steps a three-token chain does.
        """
        self._push_guesses(-1, 1.0, root)
        if lookup:
            self._push_lookup(-1, 0, lookup, match_len)
        while self._frontier and len(self._tokens) < self._budget:
            joined: list[tuple[int, _Candidate]] = []  # head guesses to expand
            while self._frontier and len(self._tokens) < self._budget and len(joined) < EXPAND_BATCH:
                if joined and not self._batches_with(self._frontier[0], joined[0][1]):
                    break  # the pending node's guesses may well beat this one: expand first
                candidate = heapq.heappop(self._frontier)
                node = self._join(candidate)
                if candidate.lookup_depth >= 0:
                    if candidate.lookup_depth + 1 < len(lookup):
                        self._push_lookup(node, candidate.lookup_depth + 1, lookup, match_len)
                elif node not in self._expanded:
                    self._expanded.add(node)
                    joined.append((node, candidate))
            if joined and len(self._tokens) < self._budget:  # no step for guesses that could not join
                features = torch.cat([candidate.feature for _, candidate in joined])  # [b, hidden]
                tokens = [candidate.token for _, candidate in joined]
                for (node, candidate), guesses in zip(
                    joined, self._head.guesses_after(features, tokens, self._top_k), strict=True
                ):
                    self._push_guesses(node, -candidate.neg_probability, guesses)
        return Proposal(tuple(self._tokens), sources=tuple(self._sources), parents=tuple(self._parents))

    @staticmethod
    def _batches_with(candidate: _Candidate, pending: _Candidate) -> bool:
        """Whether ``candidate`` may join before the guesses of ``pending`` (a head guess that joined,
        not yet expanded) are known: when it is nearly as probable, so that one step expands both
        (or, for lookup's drafts, none is needed). Stricter best-first order (expanding each node
        before the next joins) gained little in replay and cost a head step more
        (docs/drafting.md#tree-nodes)."""
        return candidate.neg_probability <= BATCH_SHARE * pending.neg_probability

    def _join(self, candidate: _Candidate) -> int:
        """The node a candidate becomes: a new one, or its equal sibling already in the tree."""
        key = (candidate.parent, candidate.token)
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = len(self._tokens)
            self._tokens.append(candidate.token)
            self._parents.append(candidate.parent)
            self._sources.append(TREE_LOOKUP_SOURCE if candidate.lookup_depth >= 0
                                 else confidence_source(TREE_HEAD_SOURCE, candidate.confidence))
            self._paths.append((*self._paths[candidate.parent], candidate.token) if candidate.parent >= 0 else (candidate.token,))
            if candidate.feature is not None:  # what the head predicted there, for a rollout over the path
                self._head.remember(self._paths[node], candidate.feature)
        return node

    def _push_guesses(self, parent: int, probability: float, guesses: HeadGuesses) -> None:
        for token, p in zip(guesses.token_ids, guesses.probs, strict=True):
            candidate = _Candidate(-probability * p, next(self._order), parent, token, guesses.feature, confidence=p)
            heapq.heappush(self._frontier, candidate)

    def _push_lookup(self, parent: int, depth: int, lookup: Sequence[int], match_len: int) -> None:
        first = LOOKUP_PROBABILITY if match_len > 1 else WEAK_MATCH_PROBABILITY
        probability = first * LOOKUP_PROBABILITY**depth
        heapq.heappush(self._frontier, _Candidate(-probability, next(self._order), parent, lookup[depth], None, depth))


class NgramFirstSession(ProposerSession):
    def __init__(
        self,
        ngram: NgramSession,
        eagle: EagleSession,
        head_k: int = 0,
        overrule_confidence: float = 0.0,
        tree_nodes: int = 0,
        tree_top_k: int = 2,
        shapes: BlockShapes | None = None,
    ) -> None:
        """``tree_nodes``: most nodes of a token tree (0 = chains); ``tree_top_k``: the head's
        guesses per tree node; ``shapes``: the service's measured choice between a tree and a chain
        for sessions that sample as this one does (None: a tree wherever one can be drafted).

        A tree's nodes are deterministic guesses, greedy and sampled sessions alike: the target
        draws its own token at each node it walks and follows the child holding it, so a sampled
        tree needs no q (``target_service.tree``)."""
        self._ngram = ngram
        self._eagle = eagle
        self._head_k = head_k  # most drafts a head block makes (0 = the block's own K)
        self._overrule_confidence = overrule_confidence  # 0 = lookup drafts whenever it matches
        self._tree_nodes = tree_nodes
        self._tree_top_k = tree_top_k
        self._shapes = shapes
        self.lookups = 0  # blocks drafted by prompt lookup
        self.head_drafts = 0  # blocks drafted by the eagle head
        self.overruled = 0  # of those, blocks where lookup had a draft the head overruled
        self.continued = 0  # head blocks that lookup continued
        self.trees = 0  # blocks drafted as token trees

    def propose(self, max_tokens: int) -> Proposal:
        proposal, match_len = self._ngram.lookup(max_tokens)
        if proposal.token_ids and match_len > 1:  # a strong match: its long copy as a chain
            self.lookups += 1
            return proposal
        budget = min(max_tokens, self._tree_nodes)
        shape = ""
        if budget > 0 and self._shapes is not None and self._eagle.has_feature:
            shape = self._shapes.choose()
            budget = 0 if shape == CHAIN else budget
        root = self._eagle.guesses(self._tree_top_k) if budget > 0 else None
        if root is not None:  # without the head's feature (a fresh session) a chain, as below
            self.trees += 1
            tree = TokenTree(self._eagle, self._tree_top_k, budget).grow(root, proposal.token_ids[:budget], match_len)
            return dataclasses.replace(tree, shape=shape)
        chain = self._chain(proposal, match_len, max_tokens)
        return dataclasses.replace(chain, shape=shape) if shape else chain

    def _chain(self, proposal: Proposal, match_len: int, max_tokens: int) -> Proposal:
        """Lookup's weak copy (``proposal``, after a match of ``match_len`` tokens), unless the head
        overrules it; else the head's block, continued by lookup."""
        if proposal.token_ids:
            if not self._head_overrules(proposal.token_ids[0], match_len):
                self.lookups += 1
                return proposal
            self.overruled += 1
        proposal = self._eagle.propose(min(max_tokens, self._head_k) if self._head_k else max_tokens)
        if proposal.token_ids:
            self.head_drafts += 1
            proposal = self._continued_by_lookup(proposal, max_tokens)
        return proposal

    def _continued_by_lookup(self, proposal: Proposal, max_tokens: int) -> Proposal:
        """The head's block, filled up to ``max_tokens`` with what lookup copies after it.

        The head drafts a few tokens; where they end on a recurring span (at least two tokens, so
        the head's last guess is not the only evidence), the rest of the block costs nothing to
        draft: the head names the next JSON key, lookup copies the line it starts. Lookup's tokens
        are deterministic given the block before them, so their q is one-hot and sampled blocks
        stay exact. It commits more tokens a round on json and code (figures:
        docs/drafting.md#lookup-continues-head-blocks).
        """
        room = max_tokens - len(proposal.token_ids)
        if room <= 0:
            return proposal
        copied = self._ngram.lookup(room, after=proposal.token_ids, ngram_min=2)[0]
        if not copied.token_ids:
            return proposal
        self.continued += 1
        one_hot = tuple(SparseDist((t,), (1.0,)) for t in copied.token_ids)
        probs = (proposal.probs + one_hot) if proposal.probs else ()  # greedy blocks carry no q
        # "copy:N" apart from "lookup:N": a span copied after guesses is a weaker bet than one after
        # committed tokens.
        sources = proposal.sources + tuple(s.replace(LOOKUP_SOURCE, COPY_SOURCE, 1) for s in copied.sources)
        return Proposal(proposal.token_ids + copied.token_ids, probs, sources if proposal.sources else ())

    def _head_overrules(self, lookup_first: int, match_len: int) -> bool:
        """Whether a lookup block copied after a one-token match gives way to the head.

        One recurring token is weak evidence: such blocks have their first draft rejected far more
        often than blocks after longer matches, and each costs a pass over K+1 rows. When the
        head's own next token differs and the head gives it at least ``overrule_confidence``, its
        block is the better bet, and it starts from the step taken to judge (a step wasted only
        where lookup's block stands). Only one-token matches are overruled (figures for the
        threshold and the match length: docs/drafting.md#head-overrules-weak-lookup-matches).
        """
        if match_len > 1 or self._overrule_confidence <= 0:
            return False
        guess = self._eagle.first_draft()
        return guess is not None and guess[0] != lookup_first and guess[1] >= self._overrule_confidence

    def next_tokens(self, n: int) -> tuple[int, ...]:
        """The head's top-``n`` where it has a feature, else lookup's next token."""
        return self._eagle.next_tokens(n) or self._ngram.next_tokens(n)

    def commit(self, base_len: int, token_ids: Sequence[int], hidden_states: torch.Tensor | None = None) -> None:
        self._ngram.commit(base_len, token_ids)
        self._eagle.commit(base_len, token_ids, hidden_states)

    def close(self) -> None:
        self._ngram.close()
        self._eagle.close()


class NgramFirstProposer(Proposer):
    kind = "ngram+eagle"

    def __init__(
        self,
        ngram: NgramProposer,
        eagle: EagleProposer,
        head_k: int = 0,
        overrule_confidence: float = 0.0,
        tree_nodes: int = 0,
        tree_top_k: int = 2,
        measure_shapes: bool = True,
    ) -> None:
        """``measure_shapes``: with ``tree_nodes`` > 0, blocks are trees or chains by which commits
        more tokens per second of round here (``draft_service.block_shape``), measured apart for
        greedy and sampled sessions; False: trees wherever one can be drafted."""
        if head_k < 0:
            raise ValueError(f"head_k must be >= 0, got {head_k}")
        if not 0.0 <= overrule_confidence <= 1.0:
            raise ValueError(f"overrule_confidence must be in [0, 1], got {overrule_confidence}")
        if tree_nodes < 0:
            raise ValueError(f"tree_nodes must be >= 0, got {tree_nodes}")
        if tree_top_k < 1:
            raise ValueError(f"tree_top_k must be >= 1, got {tree_top_k}")
        self.ngram = ngram
        self.eagle = eagle
        self.head_k = head_k
        self.overrule_confidence = overrule_confidence
        self.tree_nodes = tree_nodes  # 0 = chains
        self.tree_top_k = tree_top_k
        measured = bool(tree_nodes and measure_shapes)
        self._shapes = BlockShapes("greedy") if measured else None
        self._sampled_shapes = BlockShapes("sampled") if measured else None

    @property
    def model_name(self) -> str:
        return self.eagle.model_name

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.eagle.tokenizer_fingerprint

    @property
    def wants_hidden_states(self) -> bool:
        return True

    @property
    def block_shape(self) -> str:
        if not self.tree_nodes:
            return "chains"
        trees = f"token trees of up to {self.tree_nodes} nodes (top-{self.tree_top_k})"
        if self._shapes is not None:
            return f"{trees} or chains, whichever measures faster (greedy and sampled sessions apart)"
        return trees

    @property
    def block_shapes(self) -> BlockShapes | None:
        return self._shapes

    def shapes_for(self, sampling: SamplingParams) -> BlockShapes | None:
        return self._shapes if sampling.greedy else self._sampled_shapes

    @property
    def acceptance_prior(self) -> AcceptancePrior | None:
        """The head's: it was measured with lookup drafting beside the head (lookup and copy sources too)."""
        return self.eagle.acceptance_prior

    def new_session(self, token_ids: Sequence[int], sampling: SamplingParams,
                    shaping: LogitShaping | None = None) -> NgramFirstSession:
        return NgramFirstSession(
            self.ngram.new_session(token_ids, sampling),
            self.eagle.new_session(token_ids, sampling, shaping),
            self.head_k,
            self.overrule_confidence,
            self.tree_nodes,
            self.tree_top_k,
            self.shapes_for(sampling),
        )

    def warm_up(self) -> None:
        self.ngram.warm_up()
        self.eagle.warm_up()
