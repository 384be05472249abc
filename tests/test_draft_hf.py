"""The Hugging Face proposer: KV-cache rollback, sparse seeded sampling, vocabulary masking."""

from __future__ import annotations

import random

import pytest
import torch
from draft_fakes import greedy_continuation, load_tiny
from tiny import make_tiny_model

from draft_service.proposers.hf import HfProposer
from draft_service.proposers.sampling import draft_seed
from draft_service.types import SamplingParams

GREEDY = SamplingParams()
PROMPT = (2, 40, 41, 42, 43, 44, 45, 46)
K = 4


@pytest.fixture(scope="module")
def draft(tiny_draft_dir):
    return load_tiny(tiny_draft_dir)


@pytest.fixture(scope="module")
def gemma(tiny_gemma_dir):
    return load_tiny(tiny_gemma_dir)


def _run_rollback_rounds(loaded, rounds: int, seed: int) -> None:
    """Random verdicts (any accepted prefix, any correction); each next proposal must equal a
    cache-free greedy continuation of the committed sequence."""
    rng = random.Random(seed)
    vocab = loaded.model.config.vocab_size
    session = HfProposer(loaded).new_session(PROMPT, GREEDY)
    committed = list(PROMPT)
    for _ in range(rounds):
        proposal = session.propose(K).token_ids
        assert list(proposal) == greedy_continuation(loaded.model, committed, K)
        accepted = rng.randint(0, K)
        verdict = list(proposal[:accepted]) + [rng.randrange(3, vocab)]
        session.commit(len(committed), verdict)
        committed += verdict
        # The cache keeps exactly the committed prefix it had seen, minus the last token.
        assert session.cached_len <= len(committed) - 1


def test_rollback_after_arbitrary_accepted_prefixes(draft):
    _run_rollback_rounds(draft, rounds=12, seed=0)


def test_rollback_past_the_sliding_window(gemma):
    """Gemma 3 sliding layers (window 8): the full-history cache must roll back across the window."""
    _run_rollback_rounds(gemma, rounds=8, seed=1)


def test_rollback_below_the_last_base(draft):
    session = HfProposer(draft).new_session(PROMPT, GREEDY)
    session.propose(K)
    session.commit(len(PROMPT), (50, 51, 52))
    session.propose(K)
    # Back to a shorter sequence than the one last committed, then a different continuation.
    committed = list(PROMPT[:5]) + [60]
    session.commit(5, (60,))
    assert list(session.propose(K).token_ids) == greedy_continuation(draft.model, committed, K)


def test_context_room_limits_the_block(tmp_path):
    loaded = load_tiny(make_tiny_model(tmp_path / "short", seed=3, max_position_embeddings=12))
    proposer = HfProposer(loaded)
    assert len(proposer.new_session(PROMPT, GREEDY).propose(K).token_ids) == K  # 8 + 4 - 1 < 12
    assert len(proposer.new_session(PROMPT + (47, 48, 49), GREEDY).propose(K).token_ids) == 2
    assert proposer.new_session(tuple(range(3, 16)), GREEDY).propose(K).token_ids == ()


def _first_q(loaded, sampling, top_k=8, vocab_limit=None):
    session = HfProposer(loaded, draft_top_k=top_k, vocab_limit=vocab_limit).new_session(PROMPT, sampling)
    return session.propose(K)


def test_sampling_q_is_the_renormalised_top_k_of_the_tempered_logits(draft):
    temperature = 0.7
    proposal = _first_q(draft, SamplingParams(temperature=temperature, seed=5))
    assert len(proposal.probs) == len(proposal.token_ids) == K
    for token, dist in zip(proposal.token_ids, proposal.probs):
        assert len(dist.token_ids) <= 8 and len(set(dist.token_ids)) == len(dist.token_ids)
        assert token in dist.token_ids
        assert all(p > 0 for p in dist.probs) and sum(dist.probs) == pytest.approx(1.0, abs=1e-5)
    with torch.inference_mode():
        logits = draft.model(torch.tensor([PROMPT])).logits[0, -1]  # [vocab]
    expected = torch.softmax(logits / temperature, -1).topk(8)
    first = proposal.probs[0]
    assert list(first.token_ids) == expected.indices.tolist()
    renormalised = expected.values / expected.values.sum()
    assert torch.allclose(torch.tensor(first.probs), renormalised, atol=1e-5)


def test_sampling_is_seeded_per_session(draft):
    a = _first_q(draft, SamplingParams(temperature=1.5, seed=11))
    b = _first_q(draft, SamplingParams(temperature=1.5, seed=11))
    assert a == b
    others = {_first_q(draft, SamplingParams(temperature=1.5, seed=s)).token_ids for s in range(12, 20)}
    assert len(others | {a.token_ids}) > 1
    # The draft's stream must not be the target's (same session seed): the seed is derived.
    assert draft_seed(11) != 11 and draft_seed(11) == draft_seed(11)


def test_session_min_p_narrows_q_as_the_target_cuts(draft):
    cut = _first_q(draft, SamplingParams(temperature=0.1, seed=1, min_p=0.3), top_k=32)
    with torch.inference_mode():
        logits = draft.model(torch.tensor([PROMPT])).logits[0, -1]  # [vocab]
    probs = torch.softmax(logits / 0.1, -1)  # [vocab]
    kept = (probs >= 0.3 * probs.max()).nonzero().squeeze(1).tolist()
    assert 1 < len(kept) < 32  # within the draft's own top-k: min_p decides
    first = cut.probs[0]
    assert sorted(first.token_ids) == sorted(kept)
    expected = probs[list(first.token_ids)] / probs[kept].sum()
    assert torch.allclose(torch.tensor(first.probs), expected, atol=1e-5)


def test_session_top_k_and_top_p_narrow_q(draft):
    narrow = _first_q(draft, SamplingParams(temperature=1.0, top_k=3, seed=1))
    assert all(len(dist.token_ids) <= 3 for dist in narrow.probs)
    nucleus = _first_q(draft, SamplingParams(temperature=1.0, top_p=0.5, seed=1), top_k=32)
    for dist in nucleus.probs:
        # Kept: the smallest prefix of the sorted top-k with mass >= 0.5 (of the top-k mass).
        assert sum(dist.probs) == pytest.approx(1.0, abs=1e-5)
        assert len(dist.token_ids) < 32


def test_ids_beyond_the_target_vocabulary_are_never_proposed(draft):
    greedy_first = _first_q(draft, GREEDY).token_ids[0]
    assert greedy_first > 3, "pick another PROMPT: the masked test needs a large greedy token"
    masked = _first_q(draft, GREEDY, vocab_limit=greedy_first)
    assert masked.token_ids[0] != greedy_first
    assert all(token < greedy_first for token in masked.token_ids)
    sampled = _first_q(draft, SamplingParams(temperature=2.0, seed=0), top_k=64, vocab_limit=greedy_first)
    assert all(i < greedy_first for dist in sampled.probs for i in dist.token_ids)


def test_proposer_reports_model_and_tokenizer(draft):
    from tandem.models import tokenizer_fingerprint

    proposer = HfProposer(draft)
    assert proposer.kind == "hf"
    assert proposer.model_name == draft.name
    assert proposer.tokenizer_fingerprint == tokenizer_fingerprint(draft.tokenizer)
    proposer.warm_up()


def test_closed_session_refuses_work(draft):
    session = HfProposer(draft).new_session(PROMPT, GREEDY)
    session.propose(2)
    session.close()
    with pytest.raises(RuntimeError):
        session.propose(2)


def test_an_uncommitted_proposal_is_dropped_before_the_next(draft):
    session = HfProposer(draft).new_session(PROMPT, GREEDY)
    first = session.propose(K)
    assert session.propose(K) == first
