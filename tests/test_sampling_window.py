"""Top-k / top-p over a window of the largest logits (kernels/reference/sampling._windowed_truncation)
against the full sort of the vocabulary it stands in for: the same kept tokens and probabilities,
and the full sort wherever the window cannot decide."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import sampling

VOCAB = 4 * sampling.WINDOW


def _peaked(batch: int, n: int, seed: int) -> torch.Tensor:
    """Logits like a language model's: a few hundred likely tokens over a long flat tail."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, n, VOCAB, generator=generator) * 2  # [batch, n, vocab]
    likely = torch.randint(0, VOCAB, (batch, n, 300), generator=generator)
    return logits.scatter_add(-1, likely, torch.rand(batch, n, 300, generator=generator) * 14)


def _both(scaled, top_p, top_k):
    truncate_p = (top_p > 0) & (top_p < 1)
    return (sampling._windowed_truncation(scaled, top_p, top_k, truncate_p),
            sampling._sorted_truncation(scaled, top_p, top_k, truncate_p))


@pytest.mark.parametrize(("top_p", "top_k"), [(0.9, 0), (0.95, 0), (0.5, 0), (0.0, 50), (0.9, 40), (1.0, 2048)])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_the_window_keeps_what_the_sort_keeps(top_p: float, top_k: int, temperature: float) -> None:
    scaled = _peaked(2, 3, seed=int(top_p * 100) + top_k) / temperature
    windowed, whole = _both(scaled, torch.tensor([top_p, top_p]), torch.tensor([top_k, top_k]))
    assert windowed is not None
    assert torch.equal(windowed > 0, whole > 0)
    torch.testing.assert_close(windowed, whole, rtol=1e-5, atol=1e-7)


def test_rows_of_different_settings_share_one_window() -> None:
    scaled = _peaked(3, 2, seed=5)
    top_p, top_k = torch.tensor([0.9, 0.0, 0.8]), torch.tensor([0, 20, 100])
    windowed, whole = _both(scaled, top_p, top_k)
    assert windowed is not None and torch.equal(windowed > 0, whole > 0)
    torch.testing.assert_close(windowed, whole, rtol=1e-5, atol=1e-7)
    # target_probs takes the window, and its rows still sum to one
    probs = sampling.target_probs(scaled, torch.ones(3), top_p, top_k)
    torch.testing.assert_close(probs, whole, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "case",
    ["flat: top-p reaches past the window", "a tie at the window's edge", "top-k wider than the window",
     "a row that truncates nothing"],
)
def test_where_the_window_cannot_decide_the_full_sort_does(case: str) -> None:
    scaled, top_p, top_k = _peaked(1, 1, seed=9), torch.tensor([0.9]), torch.tensor([0])
    if case.startswith("flat"):
        scaled = torch.randn(1, 1, VOCAB, generator=torch.Generator().manual_seed(1)) * 0.1
    elif case.startswith("a tie"):
        scaled = torch.zeros(1, 1, VOCAB)
        scaled[..., :10] = 5.0  # 10 likely tokens, then thousands tied at the window's edge
    elif case.startswith("top-k"):
        top_p, top_k = torch.tensor([0.0]), torch.tensor([sampling.WINDOW + 1])
    else:
        scaled, top_p, top_k = _peaked(2, 1, seed=2), torch.tensor([0.9, 0.0]), torch.tensor([0, 0])
    windowed, whole = _both(scaled, top_p, top_k)
    assert windowed is None
    truncate_p = (top_p > 0) & (top_p < 1)
    assert torch.equal(sampling._truncated_softmax(scaled, top_p, top_k, truncate_p), whole)
