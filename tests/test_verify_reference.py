"""The PyTorch reference of chain verification and of the target distribution p, and its
row-by-row CPU twin (``kernels.rowwise``: the same rules, a token drawn from one uniform).

Deterministic cases pin the greedy rule and the tensor plumbing; the statistical cases check that
one block of rejection sampling commits tokens distributed exactly as p (speculative sampling is
lossless), for a dense q and for a one-hot q, at temperature 1 and with top-k / top-p.

Statistical bound: for each checked distribution (<= 8 categories, n >= 5000 draws) we require a
chi-square goodness-of-fit p-value > 1e-3 and a total variation distance below 4x the TV an exact
sampler has on average at that n (about 0.5 * sum_i sqrt(2 p_i (1 - p_i) / (pi n)); 0.02 at
n = 5000, 0.007 at n = 40000). Seeds are fixed, so the tests are deterministic; each case also
asserts that the naive sampler (always commit the draft token) would break the bound.

The row-by-row twin runs a Python loop per block, so its blocks are fewer and their random inputs
are a scrambled Sobol sequence instead of independent draws (the draft tokens by inverting q's
cumulative probabilities, the acceptance uniforms and the token's draw): such inputs fill the
cube evenly, and an exact sampler's TV is then a small fraction of an independent one's. So the
twin is held to 1x that mean TV, not 4x, and at 8000 blocks (at least 1000 per checked
distribution) that is stricter than 40,000 independent blocks at 4x. Its one-uniform draws
(``draw``, ``sample_tokens``) are checked on an even grid of uniforms, where inverting the
cumulative weights gives each token its share of the grid to within one point.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from kernels import rowwise
from kernels.reference import (
    draw_exponentials,
    draw_uniforms,
    exponential_race,
    sample_tokens,
    target_probs,
    verify_chain,
)

P_VALUE_FLOOR = 1e-3
TV_SLACK = 4.0
MIN_SAMPLES = 5000


def _params(batch: int, temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0):
    return (
        torch.full((batch,), temperature),  # [batch]
        torch.full((batch,), top_p),  # [batch]
        torch.full((batch,), top_k, dtype=torch.long),  # [batch]
    )


def _one_hot_q(draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic drafter's q: ``draft`` [batch, k] -> q_ids, q_probs [batch, k, 1]."""
    return draft[..., None], torch.ones(*draft.shape, 1)


def _greedy_verify(logits: torch.Tensor, draft: torch.Tensor):
    batch, k_plus_1, vocab = logits.shape
    q_ids, q_probs = _one_hot_q(draft)
    return verify_chain(
        logits, draft, q_ids, q_probs, *_params(batch),
        torch.ones(batch, k_plus_1 - 1), torch.ones(batch, vocab),
    )


# --------------------------------------------------------------------------- greedy, deterministic


@pytest.mark.parametrize("vocab", [7, 257])
def test_greedy_full_zero_and_partial_acceptance(vocab: int) -> None:
    torch.manual_seed(vocab)
    k = 4
    logits = torch.randn(3, k + 1, vocab)  # [3, k+1, vocab]
    argmax = logits.argmax(-1)  # [3, k+1]
    draft = argmax[:, :k].clone()  # [3, k]: row 0 all right
    draft[1, 0] = (argmax[1, 0] + 1) % vocab  # row 1 wrong at once
    draft[2, 2] = (argmax[2, 2] + 1) % vocab  # row 2 wrong at position 2
    num_accepted, token = _greedy_verify(logits, draft)
    assert num_accepted.tolist() == [k, 0, 2]
    # Bonus = argmax of the last row; corrections = argmax at the first mismatch.
    assert token.tolist() == [argmax[0, k].item(), argmax[1, 0].item(), argmax[2, 2].item()]


def test_greedy_k1_and_k0() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 2, 11)  # [2, 2, 11]
    argmax = logits.argmax(-1)  # [2, 2]
    draft = torch.stack([argmax[0, 0], (argmax[1, 0] + 3) % 11])[:, None]  # [2, 1]
    num_accepted, token = _greedy_verify(logits, draft)
    assert num_accepted.tolist() == [1, 0]
    assert token.tolist() == [argmax[0, 1].item(), argmax[1, 0].item()]

    empty = torch.zeros(2, 0, dtype=torch.long)  # [2, 0]: no draft at all -> just the bonus token
    num_accepted, token = _greedy_verify(logits[:, :1], empty)
    assert num_accepted.tolist() == [0, 0]
    assert token.tolist() == argmax[:, 0].tolist()


def test_greedy_accepts_by_argmax_whatever_q_says() -> None:
    torch.manual_seed(2)
    vocab, k = 9, 3
    logits = torch.randn(1, k + 1, vocab)
    draft = logits.argmax(-1)[:, :k]  # [1, k]
    # A dense q that gives the draft tokens tiny probability changes nothing for greedy rows.
    q_ids = torch.arange(vocab).expand(1, k, vocab)  # [1, k, vocab]
    q_probs = torch.full((1, k, vocab), 1.0 / vocab)
    num_accepted, token = verify_chain(
        logits, draft, q_ids, q_probs, *_params(1), torch.full((1, k), 0.999), torch.ones(1, vocab)
    )
    assert num_accepted.item() == k and token.item() == logits[0, k].argmax().item()


def test_ragged_blocks_and_mixed_greedy_and_sampled_rows() -> None:
    torch.manual_seed(3)
    vocab, k = 13, 4
    logits = torch.randn(3, k + 1, vocab)
    argmax = logits.argmax(-1)
    draft = argmax[:, :k].clone()  # every draft token is the argmax
    num_draft = torch.tensor([4, 2, 0])  # row 1 has a block of 2, row 2 an empty block
    q_ids, q_probs = _one_hot_q(draft)
    temperature = torch.tensor([0.0, 0.0, 1.0])
    num_accepted, token = verify_chain(
        logits, draft, q_ids, q_probs, temperature, torch.zeros(3), torch.zeros(3, dtype=torch.long),
        torch.ones(3, k), draw_exponentials((3, vocab), torch.Generator().manual_seed(0)), num_draft,
    )
    assert num_accepted.tolist() == [4, 2, 0]
    # Padding past a block's end is never accepted and the bonus comes from the row after it.
    assert token[:2].tolist() == [argmax[0, 4].item(), argmax[1, 2].item()]
    assert 0 <= token[2].item() < vocab


def test_low_precision_logits_are_computed_in_float32() -> None:
    torch.manual_seed(4)
    logits = torch.randn(2, 3, 50)
    draft = logits.argmax(-1)[:, :2]
    expected = _greedy_verify(logits, draft)
    got = _greedy_verify(logits.to(torch.bfloat16), logits.to(torch.bfloat16).argmax(-1)[:, :2])
    assert got[0].tolist() == expected[0].tolist() == [2, 2]


def test_sampling_is_reproducible_from_a_seed() -> None:
    torch.manual_seed(5)
    vocab, k, batch = 10, 3, 64
    logits = torch.randn(batch, k + 1, vocab)
    draft = torch.randint(0, vocab, (batch, k))
    q_ids, q_probs = _one_hot_q(draft)

    def run(seed: int):
        generator = torch.Generator().manual_seed(seed)
        return verify_chain(
            logits, draft, q_ids, q_probs, *_params(batch, temperature=1.0),
            draw_uniforms((batch, k), generator), draw_exponentials((batch, vocab), generator),
        )

    first, again, other = run(7), run(7), run(8)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not (torch.equal(first[0], other[0]) and torch.equal(first[1], other[1]))


# --------------------------------------------------------------------------- the distribution p


def test_target_probs_truncation_and_greedy() -> None:
    logits = torch.tensor([[[3.0, 1.0, 2.0, 0.0, -1.0]]]).expand(5, 1, 5)  # [5, 1, 5]
    temperature = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.5])
    top_p = torch.tensor([0.0, 0.0, 0.0, 0.8, 1.0])
    top_k = torch.tensor([0, 0, 2, 0, 0])
    p = target_probs(logits, temperature, top_p, top_k)[:, 0]  # [5, 5]
    torch.testing.assert_close(p.sum(-1), torch.ones(5))
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]  # greedy: one-hot argmax
    torch.testing.assert_close(p[1], torch.softmax(logits[1, 0], -1))
    torch.testing.assert_close(p[2], torch.softmax(torch.tensor([3.0, float("-inf"), 2.0, -1e9, -1e9]), -1))
    # softmax = [.64, .09, .24, .03, .01]: the smallest prefix reaching 0.8 is {0, 2}.
    assert (p[3] > 0).tolist() == [True, False, True, False, False]
    torch.testing.assert_close(p[4], torch.softmax(logits[4, 0] / 0.5, -1))  # top_p = 1 keeps all


def test_top_p_always_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[[5.0, 0.0, 0.0]]])
    p = target_probs(logits, torch.tensor([1.0]), torch.tensor([0.01]), torch.tensor([0]))
    assert p[0, 0].tolist() == [1.0, 0.0, 0.0]


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


def _tv_bound(probs: torch.Tensor, n: int, slack: float = TV_SLACK) -> float:
    """``slack`` x the mean TV of an exact sampler's empirical distribution from n independent draws."""
    probs = probs.double()
    return slack * 0.5 * torch.sqrt(2 * probs * (1 - probs) / (torch.pi * n)).sum().item()


def _assert_distributed_as(samples: torch.Tensor, probs: torch.Tensor, label: str, slack: float = TV_SLACK) -> None:
    """``samples`` [n] int64 are draws from ``probs`` [vocab] (chi-square and TV within ``slack`` x
    an exact sampler's mean TV, see module doc)."""
    vocab = probs.shape[0]
    counts = torch.bincount(samples, minlength=vocab).double()  # [vocab]
    support = probs > 0
    assert counts[~support].sum() == 0, f"{label}: tokens outside p's support were committed"
    expected = probs[support].double() * counts.sum()
    p_value = chisquare(counts[support].numpy(), expected.numpy() * (counts.sum() / expected.sum()).item()).pvalue
    tv, bound = _tv(counts, probs.double()), _tv_bound(probs, samples.numel(), slack)
    assert p_value > P_VALUE_FLOOR and tv < bound, f"{label}: chi-square p={p_value:.2e}, TV={tv:.4f} >= {bound:.4f}"


CASES = [  # (temperature, top_p, top_k)
    pytest.param(1.0, 0.0, 0, id="t1"),
    pytest.param(1.0, 0.0, 3, id="t1-topk3"),
    pytest.param(1.0, 0.7, 0, id="t1-topp0.7"),
    pytest.param(0.8, 0.9, 5, id="t0.8-topp0.9-topk5"),
]


# Each implementation's verify_chain, the random input of its drawn token, the blocks checked, and
# whether their random inputs are a Sobol sequence (the row-by-row twin loops in Python over rows,
# so it is checked on fewer, evenly spread; see the module doc).
IMPLEMENTATIONS = {
    "reference": (verify_chain, lambda n, vocab, g: draw_exponentials((n, vocab), g), 160_000, False),
    "rowwise": (rowwise.verify_chain, rowwise.token_draws, 8_000, True),
}
SOBOL_MIN_SAMPLES = 1000


def _sobol_inputs(n: int, q_rows: torch.Tensor, seed: int):
    """Draft tokens from ``q_rows`` [k, vocab], acceptance uniforms [n, k] and one token draw [n, 1],
    all from one scrambled Sobol sequence of 2k + 1 dimensions."""
    k, vocab = q_rows.shape
    x = torch.quasirandom.SobolEngine(2 * k + 1, scramble=True, seed=seed).draw(n, dtype=torch.float64)  # [n, 2k+1]
    cumulative = q_rows.double().cumsum(-1)  # [k, vocab]
    draft = torch.stack([torch.searchsorted(cumulative[j], x[:, k + j].contiguous() * cumulative[j, -1])
                         .clamp(max=vocab - 1) for j in range(k)], 1)  # [n, k]
    return draft, (1.0 - x[:, :k]).float(), (1.0 - x[:, 2 * k :]).float()  # uniforms on (0, 1]


# The row-by-row twin's own rules (the acceptance test, the residual, the draw) do not depend on the
# sampling parameters, which only shape p through the function both share (``target_probs``, which
# the reference's cases cover at every setting): it is checked with each kind of q, on the case that
# transforms p the most for a dense q and where a deterministic drafter's blocks are often accepted
# whole for a one-hot q.
ROWWISE_CASES = {("t0.8-topp0.9-topk5", True), ("t1-topk3", False)}


def _sampling_cases() -> list:
    """Every case with both kinds of q for the reference; ROWWISE_CASES for the row-by-row twin."""
    cases = []
    for case in CASES:
        for dense_q in (True, False):
            kind = "dense-q" if dense_q else "one-hot-q"
            cases.append(pytest.param("reference", dense_q, *case.values, id=f"reference-{kind}-{case.id}"))
            if (case.id, dense_q) in ROWWISE_CASES:
                cases.append(pytest.param("rowwise", dense_q, *case.values, id=f"rowwise-{kind}-{case.id}"))
    return cases


@pytest.mark.parametrize("impl, dense_q, temperature, top_p, top_k", _sampling_cases())
def test_rejection_sampling_reproduces_p(
    impl: str, dense_q: bool, temperature: float, top_p: float, top_k: int
) -> None:
    """Blocks of k=2: the first committed token ~ p_0; given d_1 accepted, the second ~ p_1; given
    both accepted, the bonus ~ p_2."""
    verify, token_draws, n, sobol = IMPLEMENTATIONS[impl]
    slack, min_samples = (1.0, SOBOL_MIN_SAMPLES) if sobol else (TV_SLACK, MIN_SAMPLES)
    vocab, k = 8, 2
    generator = torch.Generator().manual_seed(1234)
    row_logits = 1.5 * torch.randn(k + 1, vocab, generator=generator)  # [k+1, vocab]
    logits = row_logits.expand(n, k + 1, vocab)  # [n, k+1, vocab]
    temps, top_ps, top_ks = _params(n, temperature, top_p, top_k)
    p = target_probs(row_logits[None], temps[:1], top_ps[:1], top_ks[:1])[0]  # [k+1, vocab]

    if dense_q:  # a draft that samples its own (different) distribution at each position
        q_rows = torch.softmax(1.5 * torch.randn(k, vocab, generator=generator), -1)  # [k, vocab]
        if not sobol:  # (a Sobol run draws its drafts with its other inputs, below)
            draft = torch.stack([torch.multinomial(q_rows[j], n, replacement=True, generator=generator)
                                 for j in range(k)], 1)  # [n, k]
        q_ids = torch.arange(vocab).expand(n, k, vocab)  # [n, k, vocab]
        q_probs = q_rows.expand(n, k, vocab)  # [n, k, vocab]
    else:  # a deterministic drafter always proposing the same tokens: the target's 2nd choice, then its 1st
        fixed = torch.stack([p[0].argsort(descending=True)[1], p[1].argmax()])  # [k]
        q_rows = torch.nn.functional.one_hot(fixed, vocab).float()  # [k, vocab]
        draft = fixed.expand(n, k)  # [n, k]
        q_ids, q_probs = _one_hot_q(draft)

    if sobol:
        sobol_draft, uniforms, draws = _sobol_inputs(n, q_rows, seed=1234)
        if dense_q:
            draft = sobol_draft  # [n, k]
    else:
        uniforms, draws = draw_uniforms((n, k), generator), token_draws(n, vocab, generator)
    num_accepted, token = verify(logits, draft, q_ids, q_probs, temps, top_ps, top_ks, uniforms, draws)
    first = torch.where(num_accepted >= 1, draft[:, 0], token)  # [n]
    _assert_distributed_as(first, p[0], "first token", slack)
    reached = num_accepted >= 1  # [n]
    assert reached.sum() >= min_samples, "too few accepted first tokens to test the second position"
    second = torch.where(num_accepted[reached] == 2, draft[reached, 1], token[reached])
    _assert_distributed_as(second, p[1], "second token", slack)
    bonus = token[num_accepted == 2]
    assert bonus.numel() >= min_samples, "too few fully accepted blocks to test the bonus token"
    _assert_distributed_as(bonus, p[2], "bonus token", slack)
    # Power: committing the draft token unconditionally would be far outside the bound.
    assert 0.5 * (q_rows[0] - p[0]).abs().sum().item() > 3 * _tv_bound(p[0], n, slack)


def test_sample_tokens_and_exponential_race_draw_p() -> None:
    vocab, n = 8, 60_000
    generator = torch.Generator().manual_seed(99)
    row = torch.randn(vocab, generator=generator)
    temps, top_ps, top_ks = _params(n, 1.0, 0.9, 6)
    tokens = sample_tokens(row.expand(n, vocab), temps, top_ps, top_ks, draw_exponentials((n, vocab), generator))
    p = target_probs(row[None, None], temps[:1], top_ps[:1], top_ks[:1])[0, 0]
    _assert_distributed_as(tokens, p, "sample_tokens")

    weights = torch.tensor([0.0, 3.0, 1.0, 0.0, 4.0])  # unnormalised
    drawn = exponential_race(weights.expand(n, 5), draw_exponentials((n, 5), generator))
    _assert_distributed_as(drawn, weights / weights.sum(), "exponential race")


def test_greedy_sample_tokens_is_argmax() -> None:
    logits = torch.randn(4, 33, generator=torch.Generator().manual_seed(0))
    tokens = sample_tokens(logits, *_params(4), torch.ones(4, 33))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_uniforms_are_never_zero_and_exponentials_positive() -> None:
    generator = torch.Generator().manual_seed(0)
    u = draw_uniforms((200_000,), generator)
    e = draw_exponentials((200_000,), generator)
    assert bool((u > 0).all() and (u <= 1).all() and (e > 0).all())


def test_a_batch_mixing_greedy_and_sampled_rows_keeps_each_rows_rule() -> None:
    """All-greedy batches take a shortcut (no p over the vocabulary); mixed ones must not."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 33, generator=generator)
    temps = torch.tensor([0.0, 1.0])
    top_ps, top_ks = torch.ones(2), torch.zeros(2, dtype=torch.long)
    exponentials = draw_exponentials((2, 33), generator)
    tokens = sample_tokens(logits, temps, top_ps, top_ks, exponentials)
    assert int(tokens[0]) == int(logits[0].argmax())
    probs = target_probs(logits[1:, None], temps[1:], top_ps[1:], top_ks[1:])[:, 0]
    assert int(tokens[1]) == int(exponential_race(probs, exponentials[1:])[0])


# --------------------------------------------------------------------------- the row-by-row twin


def _grid(n: int) -> torch.Tensor:
    """[n, 1] uniforms evenly spread on (0, 1]: the midpoints of n equal steps."""
    return ((torch.arange(n, dtype=torch.float64) + 0.5) / n).float()[:, None]


def _assert_grid_shares(drawn: torch.Tensor, probs: torch.Tensor, label: str) -> None:
    """Tokens ``drawn`` [n] at ``_grid(n)`` by inverting cumulative weights: each token takes its
    share n * p_i of the grid to within one point (two, for the float32 rounding of p)."""
    n = drawn.numel()
    counts = torch.bincount(drawn, minlength=probs.numel()).double()  # [vocab]
    assert counts[probs == 0].sum() == 0, f"{label}: a token of weight 0 was drawn"
    off = (counts - n * probs.double()).abs().max().item()
    assert off <= 2.0, f"{label}: counts {counts.tolist()} against shares {(n * probs).tolist()}"


def test_rowwise_draw_and_sample_tokens_draw_p() -> None:
    vocab, n = 8, 2000
    generator = torch.Generator().manual_seed(98)
    row = torch.randn(vocab, generator=generator)
    temps, top_ps, top_ks = _params(n, 1.0, 0.9, 6)
    tokens = rowwise.sample_tokens(row.expand(n, vocab), temps, top_ps, top_ks, _grid(n))
    p = target_probs(row[None, None], temps[:1], top_ps[:1], top_ks[:1])[0, 0]
    assert (p == 0).sum() >= 2  # top-k and top-p cut some tokens
    _assert_grid_shares(tokens, p, "rowwise.sample_tokens")

    weights = torch.tensor([0.0, 3.0, 1.0, 0.0, 4.0])  # unnormalised, zeros at both ends' neighbours
    drawn = torch.stack([rowwise.draw(weights, u) for u in _grid(n)])
    _assert_grid_shares(drawn, weights / weights.sum(), "rowwise.draw")
    # The edges of (0, 1]: a uniform of 1 takes the last token of weight, a tiny one the first.
    assert int(rowwise.draw(weights, torch.tensor([1.0]))) == 4
    assert int(rowwise.draw(weights, torch.tensor([1e-12]))) == 1


def test_rowwise_draw_across_chunks_never_takes_a_token_of_weight_zero() -> None:
    """``draw`` sums chunks of ~sqrt(vocab) ids, then inside one: 30 ids are chunks of 6, whole
    chunks of zeros, zeros at chunk edges and a short tail included."""
    generator = torch.Generator().manual_seed(7)
    weights = torch.rand(30, generator=generator)
    weights[[0, 5, 6, 11, 12, 13, 14, 15, 16, 17, 29]] = 0.0  # chunk [12, 18) empty, edges zero
    n = 3000
    drawn = torch.stack([rowwise.draw(weights, u) for u in _grid(n)])
    _assert_grid_shares(drawn, weights / weights.sum(), "rowwise.draw over chunks")
    # Points on every bound between tokens, and on either side of it: never a zero-weight token.
    bounds = weights.double().cumsum(0) / weights.double().sum()
    points = torch.cat([bounds, bounds * (1 - 1e-12), (bounds * (1 + 1e-12)).clamp(max=1.0)])
    for u in points[points > 0]:  # uniforms lie in (0, 1]
        assert float(weights[int(rowwise.draw(weights, u[None].float()))]) > 0
    # Nothing left to draw from: the fallback's distribution (a residual p - q that rounding emptied).
    fallback = torch.tensor([0.0, 1.0, 0.0, 3.0])
    assert {int(rowwise.draw(torch.zeros(4), u, fallback=fallback)) for u in draw_uniforms((200, 1), generator)} == {1, 3}
    with pytest.raises(ValueError):
        rowwise.draw(torch.zeros(4), torch.tensor([0.5]))


def test_rowwise_accepts_as_the_reference_given_the_same_uniforms() -> None:
    """Acceptance is the same test on the same p: with the same uniforms the twin accepts the same
    drafts in every row; greedy rows commit the same tokens; only the drawn token's randomness differs."""
    vocab, k, batch = 50, 4, 300
    generator = torch.Generator().manual_seed(11)
    logits = 2.0 * torch.randn(batch, k + 1, vocab, generator=generator)  # [batch, k+1, vocab]
    draft = torch.where(torch.rand(batch, k, generator=generator) < 0.6, logits[:, :k].argmax(-1),
                        torch.randint(0, vocab, (batch, k), generator=generator))  # [batch, k]
    q_ids = torch.stack([draft, (draft + 1) % vocab], -1)  # [batch, k, 2]
    q_probs = torch.tensor([0.7, 0.3]).expand(batch, k, 2)
    temps = torch.where(torch.arange(batch) % 3 == 0, 0.0, 1.0)  # greedy and sampled rows mixed
    top_ps = torch.where(torch.arange(batch) % 5 == 1, 0.8, 0.0)
    top_ks = torch.zeros(batch, dtype=torch.long)
    num_draft = torch.randint(0, k + 1, (batch,), generator=generator)  # [batch]
    uniforms = draw_uniforms((batch, k), generator)
    args = (logits, draft, q_ids, q_probs, temps, top_ps, top_ks, uniforms)
    ref_accepted, ref_token = verify_chain(*args, draw_exponentials((batch, vocab), generator), num_draft)
    got_accepted, got_token = rowwise.verify_chain(*args, rowwise.token_draws(batch, vocab, generator), num_draft)
    assert got_accepted.tolist() == ref_accepted.tolist()
    greedy = temps == 0
    assert got_token[greedy].tolist() == ref_token[greedy].tolist()
    assert 0 < int((got_accepted > 0).sum()) < batch and bool((got_accepted <= num_draft).all())
    # Every drawn token is one the residual (or p, for a bonus) gives weight.
    p = target_probs(logits, temps, top_ps, top_ks)  # [batch, k+1, vocab]
    for b in torch.nonzero(~greedy)[:, 0].tolist():
        row, a = p[b, int(got_accepted[b])], int(got_accepted[b])
        if a < int(num_draft[b]):
            row = (row - torch.zeros(vocab).index_add_(0, q_ids[b, a], q_probs[b, a])).clamp_min(0)
        assert float(row[int(got_token[b])]) > 0


def test_rowwise_draws_from_p_when_p_equals_q() -> None:
    """A rejection where p == q leaves an all-zero residual (possible only through rounding): the
    token is then drawn from p, as the reference does."""
    logits = torch.tensor([0.0, 0.0, float("-inf")])[None, None].expand(1, 2, 3)  # [1, 2, 3]: p = [.5, .5, 0]
    draft = torch.tensor([[0]])
    q_ids, q_probs = torch.tensor([[[0, 1]]]), torch.tensor([[[0.5, 0.5]]])
    forced = torch.tensor([[2.0]])  # u * q(d) = 1 > p(d) = 0.5: a rejection (u is never above 1 in use)
    accepted, token = rowwise.verify_chain(logits, draft, q_ids, q_probs, *_params(1, 1.0), forced,
                                           torch.tensor([[0.9]]))
    assert accepted.tolist() == [0] and token.tolist() == [1]


def test_rowwise_greedy_sample_tokens_is_argmax() -> None:
    logits = torch.randn(4, 33, generator=torch.Generator().manual_seed(0))
    assert rowwise.sample_tokens(logits, *_params(4), torch.ones(4, 1)).tolist() == logits.argmax(-1).tolist()
