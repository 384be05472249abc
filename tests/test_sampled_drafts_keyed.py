"""benchmarks/sampled_drafts.py's keyed-draw acceptance (docs/sampling.md#seeds): the three ways a
head's first draft could meet a draw keyed by position, on distributions whose answers are known."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def keyed_acceptance():
    spec = importlib.util.spec_from_file_location(
        "sampled_drafts", Path(__file__).resolve().parent.parent / "benchmarks" / "sampled_drafts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.keyed_acceptance


def _target(vocab: int, ids: torch.Tensor, seed: int) -> torch.Tensor:
    p = torch.zeros(vocab)  # [vocab]: mass on ``ids`` and a little on every other token
    p[ids] = torch.softmax(torch.randn(len(ids), generator=torch.Generator().manual_seed(seed)), 0) * 0.9
    p += 0.1 / vocab
    return p / p.sum()


def test_a_head_with_the_targets_own_distribution_meets_every_coupled_draw(keyed_acceptance) -> None:
    ids = torch.arange(0, 500, 5)  # [100] the head's reduced vocabulary, in target ids
    p = torch.zeros(500)
    p[ids] = torch.softmax(torch.randn(100, generator=torch.Generator().manual_seed(1)), 0)
    argmax, inverse_cdf, gumbel = keyed_acceptance(p, p[ids].clone(), ids, torch.Generator().manual_seed(0))
    assert argmax == pytest.approx(float(p.max()))
    assert inverse_cdf == pytest.approx(1.0) and gumbel == 1.0


def test_a_one_token_head_is_accepted_with_the_targets_probability_of_that_token(keyed_acceptance) -> None:
    ids = torch.arange(0, 500, 5)
    p = _target(500, ids, seed=2)
    q = torch.zeros(100)
    q[7] = 1.0  # the head is sure of target id 35
    argmax, inverse_cdf, gumbel = keyed_acceptance(p, q, ids, torch.Generator().manual_seed(0))
    assert argmax == pytest.approx(float(p[35]))
    assert inverse_cdf == pytest.approx(float(p[35]), abs=1e-9)  # its interval is [0, 1]: it holds p's
    assert gumbel == pytest.approx(float(p[35]), abs=0.03)  # 4000 draws: within ~4 standard errors


def test_coupled_draws_are_accepted_at_most_as_often_as_the_total_variation_allows(keyed_acceptance) -> None:
    ids = torch.arange(0, 500, 5)
    p = _target(500, ids, seed=3)
    q = torch.softmax(torch.randn(100, generator=torch.Generator().manual_seed(4)) * 2, 0)
    bound = float(torch.minimum(p[ids], q).sum())  # sum min(p, q): no coupling of p and q does better
    argmax, inverse_cdf, gumbel = keyed_acceptance(p, q, ids, torch.Generator().manual_seed(0))
    assert inverse_cdf <= bound + 1e-9 and 0 < gumbel <= bound + 0.03
    assert argmax == pytest.approx(float(p[ids[q.argmax()]]))  # a one-hot draft: not a coupling of q
