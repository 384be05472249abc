"""benchmarks/draft_replay.py: the offline replay commits exactly what live verdicts would."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import torch

from draft_service.proposers.base import Proposer, ProposerSession
from draft_service.proposers.ngram import NgramProposer
from draft_service.types import Proposal

_spec = importlib.util.spec_from_file_location(
    "draft_replay", Path(__file__).resolve().parents[1] / "benchmarks" / "draft_replay.py"
)
draft_replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(draft_replay)

COSTS = {1: 1.0, 2: 1.0, 3: 2.0, 4: 2.0}


class Recording(Proposer):
    """A proposer that drafts a fixed guess and records every commit (a real ``Proposer``, so the
    replay sees the interface the draft service sees)."""

    def __init__(self, guess: Sequence[int]) -> None:
        self.guess = tuple(guess)
        self.commits: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

    def new_session(self, token_ids, sampling):
        proposer = self

        class Session(ProposerSession):
            def propose(self, k: int) -> Proposal:
                return Proposal(proposer.guess[:k])

            def commit(self, base_len, token_ids, hidden_states=None) -> None:
                proposer.commits.append((base_len, tuple(token_ids), tuple(hidden_states[:, 0].int().tolist())))

            def close(self) -> None:
                pass

        return Session()


def run(ids: list[int], prompt_len: int, max_tokens: int) -> dict:
    hidden = torch.arange(len(ids), dtype=torch.float32)[:, None].repeat(1, 4)  # [seq, 4]: row i holds i
    return {"domain": "code", "prompt_len": prompt_len, "ids": ids, "hidden": hidden, "max_tokens": max_tokens}


def test_rounds_commit_the_accepted_prefix_plus_one_with_the_verdicts_hidden_rows() -> None:
    ids = [1, 2, 3, 10, 11, 12, 13, 14, 15]  # prompt of 3, then 6 generated tokens
    proposer = Recording([11, 12, 99])
    tokens, rounds, seconds = draft_replay.replay(proposer, run(ids, 3, 6), 3, COSTS)
    # The prefill committed 10; round 1 drafts 11 12 99 at position 4: accepts 2, commits 11 12 13.
    assert proposer.commits[0] == (4, (11, 12, 13), (3, 4, 5))  # rows: each token's position - 1
    assert tokens == 5 and sum(len(c[1]) for c in proposer.commits) == 5
    # Then the budget (6 - 4 generated = 2 tokens) allows 1 draft (14 rejected), then none.
    assert [c[1] for c in proposer.commits] == [(11, 12, 13), (14,), (15,)]
    assert rounds == 3
    assert COSTS[4] + COSTS[2] + COSTS[1] <= seconds < COSTS[4] + COSTS[2] + COSTS[1] + 0.5  # + propose time


def test_a_tree_commits_its_longest_agreeing_root_path_is_priced_by_its_nodes_and_teaches_the_policy() -> None:
    ids = [1, 2, 3, 10, 11, 12, 13, 14, 15]
    # 11 and 99 under the last committed token, 12 under 11: the target's 11 12 is a root path.
    tree = Proposal((99, 11, 12), sources=("tree:head",) * 3, parents=(-1, -1, 1))
    proposer = Recording(())
    sessions = proposer.new_session

    def new_session(*args):
        session = sessions(*args)
        session.propose = lambda k: tree if k >= 3 else Proposal()
        return session

    proposer.new_session = new_session
    lengths = draft_replay.BlockLengthPolicy()
    for _ in range(3):
        lengths.costs.observe(2, 1.0)  # every width costs the same: no node is cut
    tokens, rounds, seconds = draft_replay.replay(proposer, run(ids, 3, 6), 3, COSTS, lengths=lengths)
    assert proposer.commits[0] == (4, (11, 12, 13), (3, 4, 5))
    assert [c[1] for c in proposer.commits] == [(11, 12, 13), (14,), (15,)]
    assert (tokens, rounds) == (5, 3)
    assert COSTS[4] + 2 * COSTS[1] <= seconds < COSTS[4] + 2 * COSTS[1] + 0.5  # 3 nodes: a pass over 4 tokens
    # It learned the tree's verdict: 99 and 11 judged at the root (11 taken), 12 under 11 taken.
    assert lengths.acceptance.rates(min_offered=1) == {("tree:head", 0): 0.5, ("tree:head", 1): 1.0}


def test_the_budget_caps_drafts_and_lookup_runs_unchanged() -> None:
    ids = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5]  # a repeating prompt continues repeating
    tokens, rounds, seconds = draft_replay.replay(NgramProposer(), run(ids, 4, 6), 3, COSTS)
    assert tokens == 5
    # 3 drafts accepted + 1 (4 tokens), then the budget leaves 1 token: an empty block.
    assert rounds == 2
    assert seconds >= COSTS[4] + COSTS[1]



def test_each_proposal_follows_a_cache_flush_and_is_timed() -> None:
    """Live, every proposal follows a target pass that evicted the caches; replay says so by
    flushing before each one, and records each proposal's own time."""
    ids = [1, 2, 3, 10, 11, 12, 13, 14, 15]
    events: list[str] = []
    proposer = Recording([11, 12, 99])
    original = proposer.new_session

    def new_session(*args):
        session = original(*args)
        propose = session.propose
        session.propose = lambda k: events.append("propose") or propose(k)
        return session

    proposer.new_session = new_session
    times: list[float] = []
    _, rounds, _ = draft_replay.replay(proposer, run(ids, 3, 6), 3, COSTS, lambda: events.append("flush"), times)
    assert events == ["flush", "propose"] * rounds
    assert len(times) == rounds and all(t >= 0 for t in times)
    flusher = draft_replay.CacheFlusher(1)
    flusher()
    flusher()
    assert flusher.buffer.numel() == 2**20 // 4 and float(flusher.buffer[0]) == 2.0
    draft_replay.CacheFlusher(0)()  # 0 MiB: nothing to write


def test_distill_prompts_are_the_held_out_generation_prompts_never_the_bench_set() -> None:
    from tandem.tools.bench.prompts import load_prompts

    prompts = draft_replay.distill_prompts("distill:24:3")
    assert len(prompts) == 24 and {p.domain for p in prompts} == {"distill"}
    assert [p.prompt for p in prompts] == [p.prompt for p in draft_replay.distill_prompts("distill:24:3")]
    assert not {p.prompt for p in prompts} & {p.prompt for p in load_prompts()}
    assert any(p.prompt.startswith(("def ", "class ")) for p in prompts)  # stdlib openings among them


def test_a_prior_written_for_some_sources_keeps_the_files_others(tmp_path):
    path = tmp_path / "acceptance.json"
    draft_replay.save_prior(path, {("head:0.5", 0): 0.5, ("tree:head:0.5", 0): 0.1}, measured_on="chains")
    draft_replay.write_prior(path, {("head:0.5", 0): 0.9, ("tree:head:0.5", 0): 0.4, ("tree:lookup", 1): 0.7},
                             "trees", sources="tree:")
    assert draft_replay.load_prior(path) == {("head:0.5", 0): 0.5, ("tree:head:0.5", 0): 0.4, ("tree:lookup", 1): 0.7}
    assert draft_replay.json.loads(path.read_text())["measured_on"] == "chains; tree:* sources: trees"
    draft_replay.write_prior(path, {("copy:2", 3): 0.8}, "all anew", sources=None)
    assert draft_replay.load_prior(path) == {("copy:2", 3): 0.8}
