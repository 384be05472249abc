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
    got = sampling._truncated_softmax(scaled, top_p, top_k, truncate_p)
    if bool(truncate_p.all()) and not bool((top_k > 0).any()):  # top-p alone: buckets, not a sort
        _assert_same_cut(got[0, 0], whole[0, 0], scaled[0, 0], float(top_p[0]))
    else:
        assert torch.equal(got, whole)


def test_top_p_alone_takes_the_buckets_and_the_window_serves_top_k(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(sampling, "_bucketed_top_p", lambda *a: calls.append("buckets") or sampling._sorted_truncation(
        a[0], a[1], torch.zeros_like(a[1], dtype=torch.long), torch.ones_like(a[1], dtype=torch.bool)))
    scaled = _peaked(2, 1, seed=3)
    sampling.target_probs(scaled, torch.ones(2), torch.tensor([0.9, 0.8]), torch.tensor([0, 0]))
    assert calls == ["buckets"]
    sampling.target_probs(scaled, torch.ones(2), torch.tensor([0.9, 0.8]), torch.tensor([0, 40]))  # a top-k row
    sampling.target_probs(scaled, torch.ones(2), torch.tensor([0.9, 1.0]), torch.tensor([0, 0]))  # a row without top-p
    many = sampling.BUCKETED_ROWS + 1  # a batch of rows (a statistical test's, a GPU reference's): batched ops
    sampling.target_probs(_peaked(many, 1, seed=4), torch.ones(many), torch.full((many,), 0.9), torch.zeros(many, dtype=torch.long))
    assert calls == ["buckets"]


def _ties_and_holes(vocab: int, seed: int) -> torch.Tensor:
    """Logits on a coarse grid (many exact ties, as in bfloat16) with a few -inf entries."""
    generator = torch.Generator().manual_seed(seed)
    row = torch.randint(-40, 8, (vocab,), generator=generator).float() / 8
    row[torch.randint(0, vocab, (5,), generator=generator)] = float("-inf")
    return row


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9, 0.95, 0.999])
@pytest.mark.parametrize("kind", ["flat", "wide", "peaked", "ties and -inf", "all equal"])
def test_buckets_keep_what_the_sort_keeps(kind: str, top_p: float) -> None:
    """Top-p alone past the window: the buckets' cut against the full sort, ties at the cut
    included (broken by the lower id), on rows of every shape."""
    generator = torch.Generator().manual_seed(int(top_p * 1000))
    scaled = {
        "flat": lambda: torch.randn(2, 2, VOCAB, generator=generator) * 0.1,
        "wide": lambda: torch.randn(2, 2, VOCAB, generator=generator) * 3,
        "peaked": lambda: _peaked(2, 2, seed=int(top_p * 100)),
        "ties and -inf": lambda: torch.stack([_ties_and_holes(VOCAB, s) for s in range(4)]).reshape(2, 2, VOCAB),
        "all equal": lambda: torch.zeros(2, 2, VOCAB),
    }[kind]()
    top_ps = torch.tensor([top_p, top_p / 2])
    bucketed = sampling._bucketed_top_p(scaled, top_ps)
    whole = sampling._sorted_truncation(scaled, top_ps, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool))
    for b in range(2):
        for i in range(2):
            _assert_same_cut(bucketed[b, i], whole[b, i], scaled[b, i], float(top_ps[b]))


def _assert_same_cut(got: torch.Tensor, expected: torch.Tensor, row: torch.Tensor, top_p: float) -> None:
    """The same kept tokens, except where the exact mass before a token lies within float32
    rounding of top_p (the sort sums float32 probabilities, which drift by ~3e-5 over 10,000 kept
    tokens; the buckets sum float64 weights), and the same probabilities otherwise."""
    values, order = row.double().sort(descending=True, stable=True)  # [vocab] the full sort's order
    weights = torch.exp(values - values[0])  # [vocab]
    before = torch.empty_like(weights).scatter_(0, order, (weights.cumsum(0) - weights) / weights.sum())  # [vocab] by id
    differ = (got > 0) != (expected > 0)  # [vocab]
    assert bool(((before[differ] - top_p).abs() < 1e-4).all()), f"tokens cut apart: {differ.nonzero().squeeze(1).tolist()}"
    if not bool(differ.any()):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
