"""``ngram+eagle``: prompt lookup first, the eagle head where lookup finds no match.

Tiny random targets and random heads: what is tested is which drafter drafts each block, that the
head's feature stays current through lookup rounds, and exactness, not acceptance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from draft_fakes import generate_greedy
from test_draft_eagle import PROMPT, load_eagle, speculate_in_process, target_info

from draft_service.proposers import make_proposer
from draft_service.proposers.ngram import NgramProposer, find_continuation
from draft_service.proposers.ngram_first import NgramFirstProposer, NgramFirstSession
from draft_service.types import Proposal, SamplingParams, SparseDist
from tandem.tools.calibrate.run import CalibrateError, load_drafter
from tandem.config import DraftSettings
from tandem.models import ModelSpecError, is_model_free_draft, ngram_first_head


@pytest.fixture
def proposer(llama, head) -> NgramFirstProposer:
    return NgramFirstProposer(NgramProposer(), load_eagle(head, llama))


def test_lookup_drafts_when_the_suffix_recurs_and_the_head_otherwise(proposer: NgramFirstProposer) -> None:
    hidden = torch.randn(3, proposer.eagle.drafter.config.hidden_size)  # [3, hidden]
    tokens = [5, 6, 7, 8, 9]  # no token recurs: lookup has nothing
    session = proposer.new_session(tokens, SamplingParams())
    assert isinstance(session, NgramFirstSession)
    assert session.propose(3).token_ids == ()  # no lookup match and no feature yet: an empty block

    session.commit(5, (10, 11, 12), hidden)  # a verdict with its hidden states
    tokens += [10, 11, 12]
    eagle_only = proposer.eagle.new_session(tokens, SamplingParams())
    eagle_only.commit(8, (), None)
    eagle_only.commit(5, (10, 11, 12), hidden)
    by_head = session.propose(3)
    assert by_head.token_ids and by_head == eagle_only.propose(3)
    assert (session.lookups, session.head_drafts) == (0, 1)

    # 7 recurs: lookup copies what followed it, and the head still gets the commit (its feature is
    # current for the next round without lookup).
    session.commit(8, (7,), hidden[-1:])
    tokens.append(7)
    assert find_continuation(torch.tensor(tokens).numpy(), 4, 1) is not None
    assert session.propose(3).token_ids == (8, 9, 10)
    assert (session.lookups, session.head_drafts) == (1, 1)
    assert session._eagle.has_feature


async def test_greedy_loop_equals_the_targets_generate(llama, proposer: NgramFirstProposer) -> None:
    n = 32
    tokens, _, blocks = await speculate_in_process(llama, proposer, n, k=3)
    assert tokens == generate_greedy(llama.model, PROMPT, n, llama.tokenizer.eos_token_id)
    assert all(b.return_hidden_states for b in blocks)
    drafted = [b for b in blocks if b.proposal.token_ids]
    assert drafted  # the random head drafts wherever lookup has nothing


async def test_seeded_sampling_is_reproducible_and_blocks_carry_the_drafters_q(llama, proposer) -> None:
    first, _, blocks = await speculate_in_process(llama, proposer, 24, k=3, temperature=1.0, seed=3)
    again, _, _ = await speculate_in_process(llama, proposer, 24, k=3, temperature=1.0, seed=3)
    assert first == again
    vocab = set(proposer.eagle.drafter.vocab_ids.tolist())
    for block in blocks:
        proposal = block.proposal
        # Lookup blocks are deterministic (no q: one-hot); head blocks carry a q per token.
        assert len(proposal.probs) in (0, len(proposal.token_ids))
        if proposal.probs:
            assert set(proposal.token_ids) <= vocab


def test_spec_resolution(llama, head, tmp_path: Path) -> None:
    spec = f"ngram+{head}"
    assert ngram_first_head(spec) == str(head) and ngram_first_head("ngram+eagle") == "eagle"
    assert ngram_first_head("ngram") is None and ngram_first_head(f"ngram+{tmp_path}") is None
    assert is_model_free_draft(spec) and is_model_free_draft("ngram+eagle") and not is_model_free_draft("gpt2")

    settings = DraftSettings(draft_model=spec, target_model=str(llama.hf_dir), device="cpu")
    made = make_proposer(settings, target_info(llama))
    assert isinstance(made, NgramFirstProposer)
    assert (made.kind, made.wants_hidden_states) == ("ngram+eagle", True)
    assert made.model_name == f"eagle:{head.name}" and made.tokenizer_fingerprint
    assert made.head_k == 3  # --eagle-k's default
    assert made.overrule_confidence == 0.3  # --eagle-overrule-confidence's default
    settings = DraftSettings(draft_model=spec, target_model=str(llama.hf_dir), device="cpu", eagle_k=0)
    assert make_proposer(settings, target_info(llama)).head_k == 0

    bad = DraftSettings(draft_model=f"ngram+{tmp_path}", target_model=str(llama.hf_dir), device="cpu")
    with pytest.raises(ModelSpecError, match="eagle head directory"):
        make_proposer(bad, target_info(llama))


def test_calibrate_asks_for_one_drafter_at_a_time(llama, head) -> None:
    with pytest.raises(CalibrateError, match="one at a time"):
        load_drafter(f"ngram+{head}", llama)
    # "auto" means lookup alone for a target tandem ships no head for.
    from tandem.tools.calibrate.drafts import NgramDrafterScorer

    assert isinstance(load_drafter("auto", llama), NgramDrafterScorer)


def test_an_eagle_block_ends_where_the_head_doubts_itself(llama, head) -> None:
    hidden = torch.randn(2, llama.model.config.hidden_size)  # [2, hidden]

    def block(min_confidence: float) -> tuple[int, ...]:
        proposer = load_eagle(head, llama, min_confidence=min_confidence)
        session = proposer.new_session(PROMPT, SamplingParams())
        session.commit(len(PROMPT), (50, 51), hidden)
        return session.propose(4).token_ids

    full = block(0.0)
    assert len(full) == 4
    # A random head over 120 tokens is never 99.9% sure: one draft, then the block ends.
    assert block(0.999) == full[:1]
    with pytest.raises(ValueError, match="min_confidence"):
        load_eagle(head, llama, min_confidence=1.0)


def test_the_head_drafts_at_most_head_k_tokens_and_lookup_keeps_k(llama, head) -> None:
    hidden = torch.randn(1, 32)  # [1, hidden]
    for head_k, expected in ((1, 1), (2, 2), (0, 3), (5, 3)):
        proposer = NgramFirstProposer(NgramProposer(), load_eagle(head, llama), head_k=head_k)
        session = proposer.new_session([5, 6, 7, 8, 9], SamplingParams())
        session.commit(5, (10,), hidden)
        assert len(session.propose(3).token_ids) == expected  # the head, capped at head_k
        session.commit(6, (7,), hidden)  # 7 recurs: lookup drafts the full K whatever head_k is
        assert session.propose(3).token_ids == (8, 9, 10)
    with pytest.raises(ValueError, match="head_k"):
        NgramFirstProposer(NgramProposer(), load_eagle(head, llama), head_k=-1)


def test_the_heads_first_draft_is_its_proposals_first_token_and_is_reused(llama, head) -> None:
    hidden = torch.randn(2, llama.model.config.hidden_size)  # [2, hidden]
    proposer = load_eagle(head, llama)
    session = proposer.new_session(PROMPT, SamplingParams())
    assert session.first_draft() is None  # no feature yet
    session.commit(len(PROMPT), (50, 51), hidden)
    token, probability = session.first_draft()
    assert 0.0 < probability <= 1.0
    fresh = proposer.new_session(PROMPT, SamplingParams())
    fresh.commit(len(PROMPT), (50, 51), hidden)
    block = fresh.propose(3)
    assert block.token_ids[0] == token
    assert session.propose(3) == block  # the kept first step gives the same block
    # A commit moves the feature: the next first draft is computed anew, as a fresh session's.
    session.commit(len(PROMPT) + 2, (token,), hidden[:1])
    fresh = proposer.new_session([*PROMPT, 50, 51, token], SamplingParams())
    fresh.commit(len(PROMPT) + 3, (), None)
    fresh.commit(len(PROMPT) + 2, (token,), hidden[:1])
    assert session.first_draft() == fresh.first_draft()


def test_the_head_overrules_a_lookup_block_from_a_one_token_match_only_when_sure_and_different(llama, head) -> None:
    hidden = torch.randn(1, llama.model.config.hidden_size)  # [1, hidden]
    eagle = load_eagle(head, llama)

    def session(tokens: list[int], overrule_confidence: float) -> NgramFirstSession:
        made = NgramFirstProposer(NgramProposer(), eagle, overrule_confidence=overrule_confidence).new_session(
            tokens[:-1], SamplingParams()
        )
        made.commit(len(tokens) - 1, tokens[-1:], hidden)  # the head's feature for the last token
        return made

    # The head's guess after token 7 (it depends on the feature and the last token only).
    guess, probability = session([5, 6, 7], 0.0)._eagle.first_draft()
    other = next(t for t in range(1, 100) if t not in (guess, 7))
    one_token_match = [7, other, 9, 7]  # 7 recurs: lookup copies (other, 9, 7)
    lookup_block = (other, 9, 7)

    sure = session(one_token_match, probability / 2)
    head_block = sure.propose(3)
    assert head_block.token_ids[0] == guess and head_block.token_ids != lookup_block
    assert (sure.lookups, sure.head_drafts, sure.overruled) == (0, 1, 1)

    for kept in (
        session(one_token_match, 0.0),  # overruling off
        session(one_token_match, min(1.0, probability * 2)),  # the head is not sure enough
        session([7, guess, 9, 7], probability / 2),  # the head agrees with lookup's first draft
    ):
        assert kept.propose(3).token_ids[1:] == (9, 7)
        assert (kept.lookups, kept.head_drafts, kept.overruled) == (1, 0, 0)
    # A match of two tokens is evidence enough: lookup drafts whatever the head thinks.
    two_token_match = session([6, 7, other, 9, 6, 7], probability / 2)
    assert two_token_match.propose(3).token_ids == (other, 9, 6)
    assert two_token_match.overruled == 0

    with pytest.raises(ValueError, match="overrule_confidence"):
        NgramFirstProposer(NgramProposer(), eagle, overrule_confidence=1.5)


def test_lookup_continues_a_head_block_that_ends_on_a_recurring_span(llama, head) -> None:
    hidden = torch.randn(1, llama.model.config.hidden_size)  # [1, hidden]
    eagle = load_eagle(head, llama)
    proposer = NgramFirstProposer(NgramProposer(), eagle, head_k=2)

    def session(tokens: list[int]) -> NgramFirstSession:
        made = proposer.new_session(tokens[:-1], SamplingParams())
        made.commit(len(tokens) - 1, tokens[-1:], hidden)
        return made

    last = 3
    drafts = session([1, last]).propose(2).token_ids  # what the head drafts after `last`
    while last in drafts:
        last += 1
        drafts = session([1, last]).propose(2).token_ids
    a, b, c = [t for t in range(20, 40) if t not in drafts][:3]
    # The head's two drafts occurred before, followed by a, b, c: lookup copies them after the head's block.
    continued = session([*drafts, a, b, c, last])
    block = continued.propose(5)
    assert block.token_ids == (*drafts, a, b, c)
    assert (continued.lookups, continued.head_drafts, continued.continued) == (0, 1, 1)
    # Each draft names its source for the block-length policy: the head with its confidence,
    # the copy with how long its context agrees (the two drafts).
    assert all(source.startswith("head:0.") for source in block.sources[:2])
    assert block.sources[2:] == ("copy:2",) * 3
    # Only the head's last draft recurs: one token is not evidence enough, the block stays the head's.
    alone = session([drafts[1] + 100, drafts[1], a, b, c, last])
    assert alone.propose(5).token_ids == drafts and alone.continued == 0
    # A sampled head block keeps its q, and the copied tokens get a one-hot q each.
    sampled = continued._continued_by_lookup(
        Proposal(drafts, (SparseDist((drafts[0],), (1.0,)), SparseDist((drafts[1], 7), (0.5, 0.5)))), 5
    )
    assert sampled.token_ids == (*drafts, a, b, c) and sampled.sources == ()  # none named: none made up
    assert sampled.probs[1] == SparseDist((drafts[1], 7), (0.5, 0.5))
    assert sampled.probs[2:] == tuple(SparseDist((t,), (1.0,)) for t in (a, b, c))
