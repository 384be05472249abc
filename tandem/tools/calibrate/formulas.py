"""The speculative decoding arithmetic of Leviathan, Kalman and Matias, "Fast Inference from
Transformers via Speculative Decoding" (ICML 2023, arXiv:2211.17192), section 3.

- Acceptance rate alpha = E_t[ sum_x min(p_t(x), q_t(x)) ] = 1 - E_t[ TV(p_t, q_t) ]: the chance
  that speculative sampling keeps a draft token (their Definition 3.1, Theorem 3.5).
- With K drafted tokens per round and i.i.d. acceptance, the tokens one target verification
  commits are E[tokens per round] = (1 - alpha^(K+1)) / (1 - alpha) (their Equation 1), of which
  E[accepted] = E[tokens per round] - 1 are draft tokens.
- If one draft step costs c target steps (their "cost coefficient"), the walltime improvement is
  (1 - alpha^(K+1)) / ((1 - alpha)(cK + 1)) (their Theorem 3.8); the best K maximises it.

When a drafter's acceptance is measured per depth (alpha_d: an EAGLE head that rolls its own
features forward gets worse with depth; prompt lookup likewise), E[tokens per round] generalises
to 1 + sum_{k=1..K} prod_{d=1..k} alpha_d, which equals Equation 1 when every alpha_d = alpha.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """(1 - alpha^(K+1)) / (1 - alpha), summed as 1 + alpha + ... + alpha^K (exact at alpha = 1)."""
    alpha = min(max(alpha, 0.0), 1.0)
    return sum(alpha**i for i in range(k + 1))


def expected_tokens_per_round_by_depth(alphas: Sequence[float], k: int) -> float:
    """1 + sum_{k'=1..K} prod_{d<=k'} alpha_d; depths beyond the measured ones reuse the last rate."""
    if not alphas:
        return 1.0
    total, survive = 1.0, 1.0
    for depth in range(k):
        survive *= min(max(alphas[min(depth, len(alphas) - 1)], 0.0), 1.0)
        total += survive
    return total


def expected_speedup(tokens_per_round: float, cost_ratio: float, k: int) -> float:
    """Tokens per round over the round's cost in target steps, (cK + 1) (Theorem 3.8)."""
    return tokens_per_round / (cost_ratio * k + 1.0)


def best_k(speedups: Sequence[float]) -> int:
    """The K (1-based) of the largest expected speedup; ties go to the smaller K (less waste)."""
    best = max(speedups)
    return next(i for i, s in enumerate(speedups, start=1) if math.isclose(s, best, rel_tol=1e-9) or s >= best)


def greedy_tokens_per_round(run_lengths: Sequence[int], k: int) -> float:
    """Empirical greedy figure: from each position the draft matches ``run`` target tokens in a
    row, so a round of K commits min(run, K) + 1 tokens."""
    if not run_lengths:
        return 1.0
    return 1.0 + sum(min(run, k) for run in run_lengths) / len(run_lengths)
