"""The target distribution p, and how one token is drawn from it (PyTorch reference).

Verification (``verify.py``) and the autoregressive path (``TargetEngine.generate``) both use
``target_probs``, so speculative and plain decoding sample exactly the same distribution.

Definition of p for one request, from raw logits, in this order (as in Hugging Face ``generate``):

1. ``temperature < GREEDY_TEMPERATURE`` (0 in practice) is greedy: p is one-hot on the argmax
   (the first index among equal maxima, like ``torch.argmax``).
2. Otherwise the logits are divided by the temperature.
3. ``top_k > 0`` keeps the ``top_k`` largest (ties broken by the lower token id); 0 keeps all.
4. ``0 < top_p < 1`` keeps the smallest prefix of the tokens sorted by probability whose mass
   reaches ``top_p`` (at least one token); 0 and 1 keep all.
5. Softmax over the kept tokens, renormalised; every other token gets probability exactly 0.

Randomness is an explicit input, never drawn inside: a token is drawn from a non-negative weight
vector w by the exponential race ``argmax(w / E)`` with ``E_i ~ Exp(1)`` i.i.d., which returns i
with probability ``w_i / sum(w)`` and needs no normalisation, cumulative sum or search. The
caller makes ``E`` (and the uniforms of ``verify.py``) from a seeded ``torch.Generator`` with
``draw_exponentials`` / ``draw_uniforms``, so a request seed reproduces its tokens.
"""

from __future__ import annotations

import torch

# Temperatures below this are greedy; dividing logits by them would overflow float32.
GREEDY_TEMPERATURE = 1e-5


def is_greedy(temperature: torch.Tensor) -> torch.Tensor:
    """Which requests decode greedily. ``temperature``: [batch] float -> [batch] bool."""
    return temperature < GREEDY_TEMPERATURE


def target_probs(
    logits: torch.Tensor,  # [batch, n, vocab], any float dtype
    temperature: torch.Tensor,  # [batch] float
    top_p: torch.Tensor,  # [batch] float
    top_k: torch.Tensor,  # [batch] int
) -> torch.Tensor:  # [batch, n, vocab] float32, each row sums to 1
    """The target distribution p at every position (see the module docstring), in float32."""
    logits = logits.float()  # [batch, n, vocab]
    vocab = logits.shape[-1]
    greedy = is_greedy(temperature)  # [batch]
    safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature).float()  # [batch]
    scaled = logits / safe_temperature[:, None, None]  # [batch, n, vocab]

    truncate_k = (top_k > 0) & (top_k < vocab)  # [batch]
    truncate_p = (top_p > 0) & (top_p < 1)  # [batch]
    if bool((truncate_k | truncate_p).any()):
        probs = _truncated_softmax(scaled, top_p, top_k, truncate_p)  # [batch, n, vocab]
    else:
        probs = torch.softmax(scaled, dim=-1)  # [batch, n, vocab]

    if bool(greedy.any()):
        # Only greedy rows become one-hot: a batch of sampled requests skips a vocabulary-sized select.
        argmax = logits[greedy].argmax(dim=-1, keepdim=True)  # [greedy rows, n, 1]
        probs[greedy] = torch.zeros_like(probs[greedy]).scatter_(-1, argmax, 1.0)
    return probs  # [batch, n, vocab]


WINDOW = 2048  # candidates a truncated softmax looks at first (see _windowed_truncation)


def _truncated_softmax(
    scaled: torch.Tensor,  # [batch, n, vocab] float32, temperature applied
    top_p: torch.Tensor,  # [batch] float
    top_k: torch.Tensor,  # [batch] int
    truncate_p: torch.Tensor,  # [batch] bool, rows where 0 < top_p < 1
) -> torch.Tensor:  # [batch, n, vocab]
    """Top-k then top-p filtering: top-p alone by buckets of logits (:func:`_bucketed_top_p`; up to
    ``BUCKETED_ROWS`` rows, as the CPU verifier scores them one at a time), else
    over the ``WINDOW`` largest logits where the kept tokens lie among them, else with one sort of
    the vocabulary (the same definition every way)."""
    if scaled.numel() <= BUCKETED_ROWS * scaled.shape[-1] and bool(truncate_p.all()) and not bool((top_k > 0).any()):
        return _bucketed_top_p(scaled, top_p)
    windowed = _windowed_truncation(scaled, top_p, top_k, truncate_p)
    return windowed if windowed is not None else _sorted_truncation(scaled, top_p, top_k, truncate_p)


def _windowed_truncation(
    scaled: torch.Tensor,  # [batch, n, vocab] float32
    top_p: torch.Tensor,  # [batch] float
    top_k: torch.Tensor,  # [batch] int
    truncate_p: torch.Tensor,  # [batch] bool
) -> torch.Tensor | None:  # [batch, n, vocab], or None where the window cannot decide
    """:func:`_sorted_truncation` over only the ``WINDOW`` largest logits of each row.

    A stable sort of a 262k vocabulary per sampled step costs a 2-core CPU about 30 ms, more than
    the model's forward pass, while the tokens top-k / top-p keep are nearly always among the first
    few thousand. The window holds the full stable sort's first ``WINDOW`` tokens in its order
    (ties by the lower id) when no logit outside it ties its smallest. top-k keeps a prefix of it
    when k <= ``WINDOW``; without top-k a token's top-p mass is its share of the whole row, and the
    window decides top-p when its own mass reaches top_p. Otherwise this returns None and the
    caller sorts the whole vocabulary. The two differ only in float rounding of the masses."""
    vocab = scaled.shape[-1]
    width = min(WINDOW, vocab)
    if width == vocab:
        return None
    kept_k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))  # [batch]
    if bool(((kept_k > width) & (kept_k < vocab)).any()):
        return None  # a top-k wider than the window: its normaliser is over tokens the window lacks
    values, ids = scaled.topk(width, dim=-1)  # [batch, n, width]
    if bool((scaled >= values[..., -1:]).sum(dim=-1).ne(width).any()):
        return None  # a tie at the window's edge: which of the tied tokens are in is the sort's to say
    ids = ids.sort(dim=-1).values  # [batch, n, width] ascending ids: a stable sort then breaks ties by id
    values, order = scaled.gather(-1, ids).sort(dim=-1, descending=True, stable=True)  # [batch, n, width] x2
    ids = ids.gather(-1, order)  # [batch, n, width]: the full sort's first ``width`` tokens
    rank = torch.arange(width, device=scaled.device)  # [width]
    keep = rank < kept_k[:, None, None]  # [batch, n, width]
    top = values[..., :1]  # [batch, n, 1]
    weights = torch.exp(values - top).masked_fill(~keep, 0.0)  # [batch, n, width]
    # The normaliser over the tokens top-k keeps: the window's own where k fits in it, else (no
    # top-k) the whole row's.
    within = (kept_k <= width)[:, None, None]  # [batch, 1, 1]
    total = torch.where(within, weights.sum(dim=-1, keepdim=True),
                        torch.exp(scaled - top).sum(dim=-1, keepdim=True))  # [batch, n, 1]
    probs = weights / total  # [batch, n, width]
    mass_before = probs.cumsum(dim=-1) - probs  # [batch, n, width]
    threshold = torch.where(truncate_p, top_p.float(), torch.full_like(top_p, 2.0, dtype=torch.float32))  # [batch]
    # Without top-k inside the window, top-p must end inside it: the window's mass must reach top_p.
    reaches = probs.sum(dim=-1, keepdim=True) >= threshold[:, None, None]  # [batch, n, 1]
    if not bool((within | (truncate_p[:, None, None] & reaches)).all()):
        return None
    keep = keep & (mass_before < threshold[:, None, None])  # [batch, n, width]; rank 0 always stays
    probs = probs * keep
    probs = probs / probs.sum(dim=-1, keepdim=True)  # [batch, n, width]
    return torch.zeros_like(scaled).scatter_(-1, ids, probs)  # [batch, n, vocab]


BUCKETS = 4096  # buckets of logit values a top-p cut sums before it sorts (see _bucketed_top_p)
# Rows a call cuts by buckets, one after another; more (a GPU reference batch, a statistical test's
# thousands of rows) take the batched window or sort.
BUCKETED_ROWS = 16
_SPAN = 104.0  # exp(x - max) is 0 in float32 this far below the maximum: such tokens share the last bucket


def _bucketed_top_p(
    scaled: torch.Tensor,  # [batch, n, vocab] float32, temperature applied
    top_p: torch.Tensor,  # [batch] float, each in (0, 1)
) -> torch.Tensor:  # [batch, n, vocab]
    """Top-p filtering (no top-k) without sorting the vocabulary: the usual request that truncates
    (the OpenAI API has top_p; top_k is an extension). A sort of 262,144 logits costs a 2-core CPU about
    30 ms, more than the model's pass, and the window of the largest logits (``WINDOW``) needs a
    topk of its own and cannot decide a flat row, whose top-p set holds tens of thousands of tokens
    (figures: docs/sampling.md#top-p-without-a-sort).

    Each row's logits fall into ``BUCKETS`` buckets of equal width below its maximum, the buckets'
    masses are summed from the top until they reach top_p, and only the bucket where they do is
    sorted. The bucket of a logit is monotone in it, so a token in a bucket above that one comes
    before it in the full sort and is kept (the mass before it falls short of top_p), a token in a
    bucket below comes after the cut, and inside the one bucket the full sort's order (descending,
    ties by the lower id) decides as :func:`_sorted_truncation` does. The two differ only in float
    rounding of the masses (here float32 sums per bucket of ``exp(x - max)``, float64 across buckets)."""
    vocab = scaled.shape[-1]
    rows = scaled.reshape(-1, vocab)  # [batch * n, vocab]
    thresholds = top_p.double().repeat_interleave(scaled.shape[1]).tolist()  # [batch * n]
    if rows.shape[0] == 1:  # the CPU verifier's case: one row at a time
        return _bucketed_row(rows[0], thresholds[0]).reshape(scaled.shape)
    return torch.stack([_bucketed_row(rows[r], thresholds[r]) for r in range(rows.shape[0])]).reshape(scaled.shape)


def _bucketed_row(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """x [vocab] float32 -> its top-p distribution [vocab] (see :func:`_bucketed_top_p`)."""
    top = x.max()
    weights = (x - top).exp_()  # [vocab], 1 at the top
    scale = BUCKETS / float((top - x.min()).clamp(min=1e-30, max=_SPAN))
    # (top - x) * scale in one pass; a NaN logit (a broken row) goes last rather than out of range.
    gap = torch.sub(top * scale, x, alpha=scale).nan_to_num_(nan=BUCKETS - 1).clamp_(max=BUCKETS - 1)  # [vocab] >= 0
    keep, _ = bucketed_prefix(gap.to(torch.int32), weights, x, top_p, descending=True)  # bucket 0 holds the top
    kept = weights.masked_fill_(~keep, 0.0)  # [vocab]
    return kept.div_(kept.sum())


def bucketed_prefix(
    bucket: torch.Tensor,  # [vocab] int32 in [0, BUCKETS), monotone in the order: a lower bucket comes first
    weights: torch.Tensor,  # [vocab] float32 >= 0, the tokens' masses (any total)
    key: torch.Tensor,  # [vocab], the order inside a bucket (ties by the lower id)
    fraction: float,  # in (0, 1]
    descending: bool = False,  # whether a larger key comes first
) -> tuple[torch.Tensor, int]:
    """The smallest prefix of the tokens in ``key``'s order whose mass reaches ``fraction`` of the
    total, found by summing the buckets' masses and sorting only the bucket where they reach it
    (top-p here, ``target_service.typical_p`` on distances): which tokens it holds [vocab] bool, and
    the id of its last token. Masses are float32 within a bucket and float64 across buckets."""
    mass = torch.bincount(bucket, weights=weights, minlength=BUCKETS).double()  # [BUCKETS]
    cumulative = mass.cumsum(0)  # [BUCKETS]
    goal = fraction * float(cumulative[-1])
    cut = min(int(torch.searchsorted(cumulative, torch.tensor([goal], dtype=torch.float64))), BUCKETS - 1)
    members = (bucket == cut).nonzero().squeeze(1)  # [m] ascending ids
    members = members[key[members].sort(descending=descending, stable=True).indices]  # [m] in the full sort's order
    inside = weights[members].double()  # [m]
    before = (float(cumulative[cut - 1]) if cut else 0.0) + inside.cumsum(0) - inside  # [m] mass before each
    taken = members[before < goal]  # [t]: the bucket's tokens in the prefix
    keep = bucket < cut  # [vocab]
    keep[taken] = True
    return keep, int(taken[-1]) if taken.numel() else int(members[0])


def _sorted_truncation(
    scaled: torch.Tensor,  # [batch, n, vocab] float32, temperature applied
    top_p: torch.Tensor,  # [batch] float
    top_k: torch.Tensor,  # [batch] int
    truncate_p: torch.Tensor,  # [batch] bool, rows where 0 < top_p < 1
) -> torch.Tensor:  # [batch, n, vocab]
    """Top-k then top-p filtering, done with one sort of the vocabulary."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [batch, n, vocab] x2
    rank = torch.arange(vocab, device=scaled.device)  # [vocab]
    kept_k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))  # [batch]
    keep = (rank < kept_k[:, None, None]).expand_as(scaled)  # [batch, n, vocab]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)  # [batch, n, vocab]

    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [batch, n, vocab]
    # Rows without top-p compare against 2, which every mass (at most 1 + rounding) is below.
    threshold = torch.where(truncate_p, top_p.float(), torch.full_like(top_p, 2.0, dtype=torch.float32))  # [batch]
    keep = keep & (mass_before < threshold[:, None, None])  # [batch, n, vocab]; rank 0 always stays
    sorted_probs = sorted_probs * keep  # [batch, n, vocab]
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)  # [batch, n, vocab]
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)  # [batch, n, vocab]


def exponential_race(
    weights: torch.Tensor,  # [batch, vocab] float, >= 0, at least one > 0 per row
    exponentials: torch.Tensor,  # [batch, vocab] float, Exp(1) draws, > 0
) -> torch.Tensor:  # [batch] int64
    """Draws token i with probability ``weights[i] / weights.sum()`` (unnormalised weights)."""
    return (weights / exponentials).argmax(dim=-1)  # [batch]


def sample_tokens(
    logits: torch.Tensor,  # [batch, vocab], any float dtype
    temperature: torch.Tensor,  # [batch] float
    top_p: torch.Tensor,  # [batch] float
    top_k: torch.Tensor,  # [batch] int
    exponentials: torch.Tensor,  # [batch, vocab] float, Exp(1) draws (ignored for greedy rows)
) -> torch.Tensor:  # [batch] int64
    """One autoregressive step: a token from p (the argmax for greedy requests)."""
    greedy = is_greedy(temperature)  # [batch]
    if bool(greedy.all()):
        # Nothing to sample: skip building p over the whole vocabulary (a softmax and a top-p sort
        # of 262k entries cost a CPU decoding step about 1 ms, 3% of gemma-3-270m's step).
        return logits.argmax(dim=-1)  # [batch]
    probs = target_probs(logits[:, None, :], temperature, top_p, top_k)[:, 0]  # [batch, vocab]
    sampled = exponential_race(probs, exponentials)  # [batch]
    return torch.where(greedy, logits.argmax(dim=-1), sampled)  # [batch]


def draw_uniforms(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Uniform draws on (0, 1] (never exactly 0), float32, on the generator's device."""
    return 1.0 - torch.rand(shape, generator=generator, device=generator.device)


def token_draws(batch: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """The random input of one drawn token per row: [batch, vocab] Exp(1) draws (the exponential race)."""
    return draw_exponentials((batch, vocab_size), generator)


def draw_exponentials(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Exp(1) draws, float32, strictly positive (so ``w / E`` never divides by zero)."""
    exponentials = -torch.log(draw_uniforms(shape, generator))
    return exponentials.clamp_min(torch.finfo(torch.float32).tiny)
