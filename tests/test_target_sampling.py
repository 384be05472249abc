"""Sampling losslessness through the engine: speculative sessions produce exactly the target's
distribution over sequences.

A random Llama with a 5-token vocabulary is the target. Each trial prefills a fresh session (its
own seed), sends one block (2 draft tokens sampled from a sparse q, different from p and partly
outside p's support; or a fixed token tree of deterministic guesses) and generates until 3 tokens
are committed. Trials run 50 at a time, each step of theirs in one batched engine pass (the
serving path under load; ``engine_sessions``). The empirical joint
distribution of those 3 tokens (125 cells) is compared with the exact joint computed from full
forward passes: chi-square goodness of fit (cells expecting < 5 pooled) with p-value > 1e-3, and
total variation below 1.5x the mean TV of an exact sampler at that sample size. Seeds are fixed,
so the test is deterministic. One chain case adds min_p (``target_service.min_p``) under top-p, and
shows that the other order of the two (min_p last) would fail it; another cuts by typical_p
(``target_service.typical_p``).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from engine_sessions import decode_step, run_together
from model_fixtures import VOCAB  # the vocabulary of the small_vocab_target fixture
from scipy.stats import chisquare

from kernels.reference import target_probs
from target_service.planner import DecodeStep
from target_service.types import DraftBlock, SparseDist
from target_service.engine import TargetEngine
from target_service.session import SessionConfig
from test_target_typical_p import typical_kept

PROMPT = [1, 4, 2, 3]
TRIALS = 2500
# The draft's q at block positions 1 and 2: sparse, and unlike the target's p.
Q = (SparseDist((0, 1, 2), (0.5, 0.3, 0.2)), SparseDist((3, 4), (0.7, 0.3)))


def exact_joint(model, temperature: float, top_p: float, top_k: int, min_p: float = 0.0,
                min_p_last: bool = False, typical_p: float = 0.0) -> np.ndarray:
    """P(t1, t2, t3) after PROMPT, [VOCAB, VOCAB, VOCAB], from uncached forward passes. ``min_p``
    drops the tokens below min_p times the best one's probability (after the temperature) before
    top-k and top-p, as vLLM orders them; ``min_p_last`` after them instead (Hugging Face's and
    llama.cpp's order, to show that the order is tested). ``typical_p`` keeps each row's typical set
    (by its definition), after min_p and before top-k and top-p."""
    params = (torch.tensor([temperature]), torch.tensor([top_p]), torch.tensor([top_k]))

    @torch.inference_mode()
    def p(prefix: list[int]) -> np.ndarray:
        logits = model(torch.tensor([PROMPT + prefix])).logits[:, -1:].double()  # [1, 1, vocab]
        if min_p and not min_p_last:
            logits = logits.masked_fill(~_min_p_kept(logits, temperature, min_p), float("-inf"))
        if typical_p:
            logits = logits.masked_fill(~typical_kept(logits[0], temperature, typical_p)[0][None], float("-inf"))
        probs = target_probs(logits, *params).double()  # [1, 1, vocab]
        if min_p and min_p_last:
            probs = probs * _min_p_kept(logits, temperature, min_p)
        return (probs / probs.sum())[0, 0].numpy()

    joint = np.zeros((VOCAB,) * 3)
    p1 = p([])
    for t1 in range(VOCAB):
        p2 = p([t1])
        for t2 in range(VOCAB):
            joint[t1, t2] = p1[t1] * p2[t2] * p([t1, t2])
    return joint


def _min_p_kept(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """Which tokens min_p keeps, by its definition over probabilities (float64): p >= min_p * max(p)."""
    probs = torch.softmax(logits / temperature, dim=-1)  # [..., vocab]
    return probs >= min_p * probs.amax(dim=-1, keepdim=True)


# A token tree of deterministic guesses: 0 and 2 after the root, 1 and 3 after 0, 4 after 2.
TREE_TOKENS, TREE_PARENTS = (0, 2, 1, 3, 4), (-1, -1, 0, 0, 1)


def chain_block(rng: random.Random, base_len: int, session_id: str = "s") -> DraftBlock:
    drafts = tuple(rng.choices(q.token_ids, weights=q.probs)[0] for q in Q)
    return DraftBlock(session_id, base_len, drafts, draft_probs=Q)


def tree_block(rng: random.Random, base_len: int, session_id: str = "s") -> DraftBlock:
    return DraftBlock(session_id, base_len, TREE_TOKENS, draft_parents=TREE_PARENTS)


def sample_sequences(engine: TargetEngine, temperature: float, top_p: float, top_k: int, min_p: float,
                     block=chain_block, typical_p: float = 0.0) -> np.ndarray:
    """Counts of the first 3 generated tokens over TRIALS speculative sessions, run 50 at a time
    (``run_together``): prefilled, one block verified, then decoded until each has 3."""
    rng = random.Random(0)
    configs = [SessionConfig(max_new_tokens=3, temperature=temperature, top_p=top_p, top_k=top_k, seed=trial,
                             ignore_eos=True, min_p=min_p, typical_p=typical_p) for trial in range(TRIALS)]

    def one_block(session_id: str, tokens: list[int], call: int) -> DraftBlock | DecodeStep:
        return block(rng, len(PROMPT) + len(tokens), session_id) if call == 1 else decode_step(session_id, tokens, call)

    counts = np.zeros((VOCAB,) * 3)
    for tokens in run_together(engine, PROMPT, configs, one_block):
        assert len(tokens) == 3, tokens
        counts[tuple(tokens)] += 1
    return counts


def assert_matches(counts: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square and TV checks of sampled ``counts`` against the ``expected`` joint (both raveled);
    returns the mean TV of an exact sampler at this sample size."""
    assert counts.sum() == TRIALS
    assert counts[expected == 0].sum() == 0, "a sequence the target cannot produce was produced"
    expected_counts = expected * TRIALS
    big = expected_counts >= 5
    small = (expected_counts < 5) & (expected > 0)  # pooled into one cell
    observed, wanted = counts[big], expected_counts[big]
    if small.any():
        observed = np.append(observed, counts[small].sum())
        wanted = np.append(wanted, expected_counts[small].sum())
    wanted = wanted * observed.sum() / wanted.sum()  # float32 probabilities: make the totals agree exactly
    p_value = chisquare(observed, wanted).pvalue

    tv = 0.5 * np.abs(counts / TRIALS - expected).sum()
    mean_tv = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * TRIALS)) for p in expected)
    assert p_value > 1e-3 and tv < 1.5 * mean_tv, f"chi-square p={p_value:.2e}, TV={tv:.4f} (exact ~{mean_tv:.4f})"
    assert abs(expected.sum() - 1) < 1e-6 and (expected > 0.01).sum() >= 20  # spread over many sequences
    return mean_tv


CASES = [
    pytest.param(1.0, 0.0, 0, 0.0, id="t1"),
    pytest.param(0.9, 0.8, 4, 0.0, id="t0.9-topp0.8-topk4"),
    pytest.param(1.6, 0.8, 0, 0.4, id="t1.6-topp0.8-minp0.4"),
]


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", CASES)
def test_speculative_sampling_matches_the_target_distribution(
    small_vocab_target, one_thread, temperature, top_p, top_k, min_p
) -> None:
    engine = TargetEngine(small_vocab_target)
    expected = exact_joint(small_vocab_target.model, temperature, top_p, top_k, min_p).ravel()
    counts = sample_sequences(engine, temperature, top_p, top_k, min_p).ravel()
    mean_tv = assert_matches(counts, expected)
    if min_p:
        # Power: min_p after top-p (Hugging Face's order) would be outside the TV bound.
        other = exact_joint(small_vocab_target.model, temperature, top_p, top_k, min_p, min_p_last=True).ravel()
        assert 0.5 * np.abs(other - expected).sum() > 3 * mean_tv
    # The test has power: committing the draft tokens unconditionally (t2 ~ q_1, t3 ~ q_2) would be
    # far outside the TV bound.
    naive = np.einsum("a,b,c->abc", expected.reshape((VOCAB,) * 3).sum((1, 2)), *(_dense(q) for q in Q)).ravel()
    assert 0.5 * np.abs(naive - expected).sum() > 3 * mean_tv


def test_speculative_sampling_keeps_the_typical_set(small_vocab_target, one_thread) -> None:
    """Chains verified against rows cut by typical_p give the cut distribution's exact joint."""
    engine = TargetEngine(small_vocab_target)
    expected = exact_joint(small_vocab_target.model, 1.4, 0.0, 0, typical_p=0.75).ravel()
    counts = sample_sequences(engine, 1.4, 0.0, 0, 0.0, typical_p=0.75).ravel()
    mean_tv = assert_matches(counts, expected)
    uncut = exact_joint(small_vocab_target.model, 1.4, 0.0, 0).ravel()  # power: the cut is felt
    assert 0.5 * np.abs(uncut - expected).sum() > 3 * mean_tv


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", CASES[:2])  # min_p cuts each row as in chains
def test_sampled_token_trees_match_the_target_distribution(
    small_vocab_target, one_thread, temperature, top_p, top_k, min_p
) -> None:
    """A sampled session's tree block: the target draws its token at each node on the walk and
    follows the child holding it, so every committed token is the target's own draw."""
    engine = TargetEngine(small_vocab_target)
    expected = exact_joint(small_vocab_target.model, temperature, top_p, top_k, min_p).ravel()
    counts = sample_sequences(engine, temperature, top_p, top_k, min_p, block=tree_block).ravel()
    mean_tv = assert_matches(counts, expected)
    # Power: a walk that took the root's first child whenever the target's draw was either child
    # (ignoring which one was drawn) would be outside the TV bound (1.5x mean) by a margin.
    biased = expected.reshape((VOCAB,) * 3).copy()
    biased[0] += biased[2]  # the mass of sequences starting 2 moved onto ones starting 0
    biased[2] = 0
    assert 0.5 * np.abs(biased.ravel() - expected).sum() > 2 * mean_tv


def _dense(q: SparseDist) -> np.ndarray:
    dense = np.zeros(VOCAB)
    dense[list(q.token_ids)] = q.probs
    return dense

