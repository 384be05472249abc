"""Position-wise comparison of the target's and the draft's next-token distributions.

Everything here works on log-probabilities over the target's vocabulary, [n, V] for n positions.
A draft that gives a token no probability at all (an EAGLE head outside its reduced vocabulary, a
draft with a smaller vocabulary) has log q = -inf there; KL(p||q) is then infinite in theory, so
log q is floored at ``LOG_EPS`` (1e-10) and the mass p puts there is reported separately.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

LOG_EPS = math.log(1e-10)


@dataclass
class Comparison:
    """One row per position: KL(p||q), sum_x min(p, q), argmax agreement, p's mass where q = 0."""

    kl: torch.Tensor  # [n]
    overlap: torch.Tensor  # [n]
    greedy_match: torch.Tensor  # [n] bool
    outside_mass: torch.Tensor  # [n]


def align_vocab(logq: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft log-probs [n, Vq] on the target's vocabulary [n, V]: extra rows dropped (their mass can
    never be accepted), missing rows -inf."""
    n, vq = logq.shape
    if vq == vocab_size:
        return logq
    if vq > vocab_size:
        return logq[:, :vocab_size]
    pad = torch.full((n, vocab_size - vq), float("-inf"), dtype=logq.dtype, device=logq.device)
    return torch.cat([logq, pad], dim=1)


def compare(logp: torch.Tensor, logq: torch.Tensor) -> Comparison:
    """logp, logq: [n, V] log-probabilities (logq may hold -inf)."""
    p = logp.exp()
    q = logq.exp()
    kl = torch.special.xlogy(p, p).sum(-1) - (p * logq.clamp_min(LOG_EPS)).sum(-1)  # [n]
    return Comparison(
        kl=kl.clamp_min(0.0),
        overlap=torch.minimum(p, q).sum(-1),
        greedy_match=logp.argmax(-1) == logq.argmax(-1),
        outside_mass=(p * (q == 0)).sum(-1),
    )


def leading_matches(matches: torch.Tensor) -> torch.Tensor:
    """[n, D] bool -> [n] int: how many leading positions match (the greedy accepted length)."""
    return matches.to(torch.int64).cumprod(dim=1).sum(dim=1)


@dataclass
class Stats:
    """Accumulated over prompts (per domain and overall)."""

    max_k: int
    kl: list[float] = field(default_factory=list)
    greedy_match: list[bool] = field(default_factory=list)
    outside_mass: list[float] = field(default_factory=list)
    overlap_by_depth: list[list[float]] = field(default_factory=list)  # [depth][position]
    runs: list[int] = field(default_factory=list)  # greedy accepted length from each start, <= max_k

    def __post_init__(self) -> None:
        if not self.overlap_by_depth:
            self.overlap_by_depth = [[] for _ in range(self.max_k)]

    def add(self, other: Stats) -> None:
        self.kl += other.kl
        self.greedy_match += other.greedy_match
        self.outside_mass += other.outside_mass
        for mine, theirs in zip(self.overlap_by_depth, other.overlap_by_depth):
            mine += theirs
        self.runs += other.runs

    @property
    def positions(self) -> int:
        return len(self.greedy_match)

    def alphas_by_depth(self) -> list[float]:
        """Mean acceptance at each measured depth (depths with no sample are left out)."""
        return [sum(v) / len(v) for v in self.overlap_by_depth if v]


def conditional_rates_from_runs(runs: list[int], max_k: int) -> list[float]:
    """alpha_d = P[run >= d | run >= d-1] from greedy accepted lengths: the per-depth rates of a
    drafter with no distribution (prompt lookup), such that 1 + sum_k prod_{d<=k} alpha_d equals
    the measured 1 + E[min(run, K)]."""
    rates: list[float] = []
    for depth in range(1, max_k + 1):
        reached = sum(1 for r in runs if r >= depth - 1)
        if not reached:
            break
        rates.append(sum(1 for r in runs if r >= depth) / reached)
    return rates
