"""Chain verification, fused into one Triton kernel (CUDA path of ``kernels.reference.verify_chain``).

Same signature and semantics as the reference (read its module docstring for the rule: an
**accepted** draft token passes ``u * q(d) <= p(d)``; after the first rejection a **recovered** token
is drawn from ``norm(max(0, p - q))``; after a fully accepted block a **bonus** token from ``p``).

Work split. One program per (request b, row j), ``j in 0..k``: row j holds the target's logits
after ``d_1..d_j``. Every program decides, independently of the others,

- ``accept[b, j]``: would draft token ``d_{j+1}`` pass its test (false for ``j >= num_draft``), and
- ``candidate[b, j]``: the token committed if the block stops at row j: the greedy argmax, or the
  exponential race ``argmax(max(0, p_j - q_j) / E)`` (``p_j / E`` at the bonus row).

A second, tiny kernel (one program per request) counts the leading accepts and picks
``candidate[b, num_accepted]``. Computing a candidate for rows after the first rejection is
wasted arithmetic, but it keeps every row in flight at once and the logits of every row must be
read anyway for its acceptance test. The exponentials are one row per request, shared by its k+1
programs, so they come from HBM once and from L2 after that. (At batch 1 and small k this gives
few programs, each streaming a whole row; splitting a row over several programs is the next
step if the benchmark shows small batches latency-bound.)

Passes over a vocabulary row (each pass streams the row in tiles of ``BLOCK`` tokens):

- greedy row: one pass (argmax, first index among equal maxima, like ``torch.argmax``);
- sampled row: one statistics pass (max and softmax denominator, online) and one race pass that
  also builds the residual ``max(0, p - q)`` tile by tile. q is sparse (``m`` ids per row): a tile
  finds its q values by comparing its token ids with the row's ``m`` ids (``[BLOCK, M]`` compares,
  no dense q is ever written), so ``m`` is meant to be small (a draft's top-k), 1 for
  deterministic drafters. No prefix sum of probabilities is needed: the race needs no
  normalisation and the acceptance test reads one probability.
- top-k / top-p rows find their cut-off without sorting, by a bisection over the logit *value*
  (``_bisect_threshold``): each pass counts (top-k) or sums the probability mass (top-p) of the
  tokens at or above ``NUM_PIVOTS`` candidate values at once, so the 2^32 float32 values shrink
  by ``NUM_PIVOTS + 1`` per pass (8 passes with 16 pivots), and one more pass resolves ties at
  the cut-off value by token id (an in-tile running count of the tied tokens), exactly as the
  reference's stable sort does. Top-k costs 8 + 1 passes plus one for its softmax denominator,
  top-p 8 + 1. A row (256 KB of bf16 for Llama-3) should stay L2-resident across them.
Everything is computed in float32 whatever the logits' dtype (the interpreter also mishandles
bf16 arithmetic). Results equal the reference's token for token except where two float32
quantities that the reference compares are within rounding of each other (a race between two
tokens whose ``w / E`` agree to ~1e-7, an acceptance test with ``u * q`` within an ulp of ``p``, or
a top-p mass within rounding of ``top_p``): both are then valid draws, they just round apart.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference.sampling import GREEDY_TEMPERATURE

# Candidate cut-off values evaluated per bisection pass (see _bisect_threshold); a power of two.
# A pass costs ALU work per pivot and per token (a [BLOCK, NUM_PIVOTS] compare), and 16 pivots
# (8 passes) balance those compares against re-reads of the L2-resident row.
NUM_PIVOTS = 16
# Tokens per tile; the launcher takes the smaller of this and the vocabulary's next power of two,
# and less when q has many ids per row (a tile compares each token with each id).
MAX_BLOCK = 1024
MAX_TILE_COMPARES = 16384


@triton.jit
def _order_key(s):
    """float32 -> int64 key with the same order (``a < b`` iff ``key(a) < key(b)``; -0.0 == +0.0).

    Non-negative floats already order as their bit patterns; negative ones order in reverse, so
    their 31 magnitude bits are flipped.
    """
    bits = (s + 0.0).to(tl.int32, bitcast=True)  # + 0.0 turns -0.0 into +0.0
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _is_kept(key, offs, thr_key, thr_id):
    """Membership in a prefix of the order (value descending, token id ascending).

    The prefix is named by the last value it keeps (``thr_key``) and, among the tokens tied at that
    value, the first id it drops (``thr_id``).
    """
    return (key > thr_key) | ((key == thr_key) & (offs < thr_id))


@triton.jit
def _scaled_tile(row_ptr, offs, vocab, temperature):
    """The row's logits of one tile divided by the temperature, float32; padding is -inf."""
    x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)  # [BLOCK]
    return x / temperature


@triton.jit
def _bisect_threshold(
    row_ptr, vocab, temperature, row_max,
    keep_key, keep_id,  # the prefix to search within (all tokens, or top-k's)
    target,  # count (USE_MASS False) or unnormalised mass (USE_MASS True) the prefix must reach
    USE_MASS: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):
    """The shortest prefix of the (value desc, id asc) order whose count or mass reaches ``target``.

    Bisection over the value, in key space: the invariant is ``f(lo) >= target > f(hi)`` with
    ``f(c)`` the count (or the mass ``sum exp(s - row_max)``) of the kept tokens whose key is ``>=
    c``. A pass evaluates f at ``NUM_PIVOTS`` evenly spaced keys in ``(lo, hi)`` and keeps the
    tightest bracket. When ``hi == lo + 1``, ``lo`` is the key of the last token of the prefix and
    ``f(hi)`` what the strictly larger values hold. A last pass then walks the tokens tied at
    ``lo`` in id order (a running count plus an in-tile cumulative sum over the tie mask) and keeps
    ties while the prefix still falls short of ``target`` before them, which is the reference's
    rule: top-k keeps ``rank < k``, top-p keeps ``mass_before < top_p``.

    Returns ``(thr_key, thr_id, mass)``: the prefix as ``_is_kept`` reads it, and its total
    unnormalised mass (the new softmax denominator).
    """
    lo = tl.full([], -(2**31), tl.int64)  # f(lo) = everything kept >= target
    hi = tl.full([], 2**31, tl.int64)  # f(hi) = 0 < target
    f_hi = tl.zeros([], tl.float32)
    pivot_idx = tl.arange(0, NUM_PIVOTS).to(tl.int64)  # [NUM_PIVOTS]
    while hi - lo > 1:
        pivots = lo + (hi - lo) * (pivot_idx + 1) // (NUM_PIVOTS + 1)  # [NUM_PIVOTS] int64, in [lo, hi)
        f = tl.zeros([NUM_PIVOTS], tl.float32)  # [NUM_PIVOTS]
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)  # [BLOCK]
            s = _scaled_tile(row_ptr, offs, vocab, temperature)  # [BLOCK]
            key = _order_key(s)  # [BLOCK]
            kept = _is_kept(key, offs, keep_key, keep_id) & (offs < vocab)  # [BLOCK]
            if USE_MASS:
                w = tl.where(kept, tl.exp(s - row_max), 0.0)  # [BLOCK]
            else:
                w = kept.to(tl.float32)  # [BLOCK]
            above = key[:, None] >= pivots[None, :]  # [BLOCK, NUM_PIVOTS]
            f += tl.sum(tl.where(above, w[:, None], 0.0), axis=0)  # [NUM_PIVOTS]
        reached = f >= target  # [NUM_PIVOTS]; f is non-increasing along the pivots
        new_lo = tl.max(tl.where(reached, pivots, lo), axis=0)
        new_hi = tl.min(tl.where(reached, hi, pivots), axis=0)
        # f at the new hi: the largest f among the pivots that fall short (f is non-increasing).
        f_hi = tl.where(new_hi == hi, f_hi, tl.max(tl.where(reached, float("-inf"), f), axis=0))
        lo = new_lo
        hi = new_hi

    # Ties at the cut-off value, in id order.
    value_w = tl.exp(tl.where(lo >= 0, lo, lo ^ 0x7FFFFFFF).to(tl.int32).to(tl.float32, bitcast=True) - row_max)
    ties_before = tl.zeros([], tl.int32)
    thr_id = tl.zeros([], tl.int32)
    kept_ties = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)  # [BLOCK]
        key = _order_key(_scaled_tile(row_ptr, offs, vocab, temperature))  # [BLOCK]
        tie = (key == lo) & _is_kept(key, offs, keep_key, keep_id) & (offs < vocab)  # [BLOCK]
        rank = ties_before + tl.cumsum(tie.to(tl.int32), axis=0) - tie.to(tl.int32)  # [BLOCK] exclusive
        if USE_MASS:
            short = f_hi + rank.to(tl.float32) * value_w < target  # [BLOCK]
        else:
            short = f_hi + rank.to(tl.float32) < target  # [BLOCK]
        keep_tie = tie & short  # [BLOCK]
        thr_id = tl.maximum(thr_id, tl.max(tl.where(keep_tie, offs + 1, 0), axis=0))
        kept_ties += tl.sum(keep_tie.to(tl.int32), axis=0)
        ties_before += tl.sum(tie.to(tl.int32), axis=0)
    if USE_MASS:
        mass = f_hi + kept_ties.to(tl.float32) * value_w
    else:
        mass = tl.zeros([], tl.float32)  # not needed by callers of the count form
    return lo, thr_id, mass


@triton.jit
def _row_distribution(
    row_ptr, vocab, temperature, safe_temperature, greedy_temperature, top_p_ptr, top_k_ptr,
    BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):
    """Everything that defines p on one row, without materialising it.

    Returns ``(argmax, row_max, denom, keep_key, keep_id)``: p(v) = ``exp(s_v - row_max) / denom``
    for the tokens that ``_is_kept(key(s_v), v, keep_key, keep_id)`` keeps and 0 elsewhere, with
    ``s = logits / T``. One pass (argmax, online max and denominator); top-k / top-p rows add the
    bisection passes of their cut-offs and the denominator over the kept prefix.
    """
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.zeros([], tl.int32)
    row_max = tl.full([], float("-inf"), tl.float32)
    denom = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)  # [BLOCK]
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)  # [BLOCK]
        tile_best = tl.max(x, axis=0)
        tile_id = tl.argmax(x, axis=0)  # first index among equal maxima
        take = tile_best > best  # strict: an earlier tile wins ties
        best_id = tl.where(take, start + tile_id, best_id)
        best = tl.where(take, tile_best, best)
        s = x / safe_temperature  # [BLOCK]
        new_max = tl.maximum(row_max, tl.max(s, axis=0))
        # A row that is -inf so far has nothing to rescale (and -inf - -inf would be NaN).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        denom = denom * tl.exp(row_max - shift) + tl.sum(tl.exp(s - shift), axis=0)
        row_max = new_max

    # The kept prefix of (value desc, id asc): all tokens, then top-k's, then top-p's within it.
    keep_key = tl.full([], -(2**31) - 1, tl.int64)  # below every float32 key: keep all
    keep_id = tl.zeros([], tl.int32)
    if temperature >= greedy_temperature:  # greedy rows need only the argmax
        top_k = tl.load(top_k_ptr).to(tl.int32)
        top_p = tl.load(top_p_ptr).to(tl.float32)
        if (top_k > 0) & (top_k < vocab):
            keep_key, keep_id, _unused = _bisect_threshold(
                row_ptr, vocab, safe_temperature, row_max, keep_key, keep_id, top_k.to(tl.float32),
                USE_MASS=False, BLOCK=BLOCK, NUM_PIVOTS=NUM_PIVOTS,
            )
            # The softmax denominator over the top-k prefix.
            denom = tl.zeros([], tl.float32)
            for start in range(0, vocab, BLOCK):
                offs = start + tl.arange(0, BLOCK)  # [BLOCK]
                s = _scaled_tile(row_ptr, offs, vocab, safe_temperature)  # [BLOCK]
                kept = _is_kept(_order_key(s), offs, keep_key, keep_id) & (offs < vocab)  # [BLOCK]
                denom += tl.sum(tl.where(kept, tl.exp(s - row_max), 0.0), axis=0)
        if (top_p > 0) & (top_p < 1):
            keep_key, keep_id, denom = _bisect_threshold(
                row_ptr, vocab, safe_temperature, row_max, keep_key, keep_id, top_p * denom,
                USE_MASS=True, BLOCK=BLOCK, NUM_PIVOTS=NUM_PIVOTS,
            )
    return best_id, row_max, denom, keep_key, keep_id


# k and m change with every block; specialising on them (k == 1, m % 16 == 0, ...) would only
# multiply compilations.
@triton.jit(do_not_specialize=["k", "m"])
def _verify_rows_kernel(
    logits_ptr,  # [batch, k+1, vocab] any float dtype, contiguous
    draft_ptr,  # [batch, k] int64
    q_ids_ptr,  # [batch, k, m] int64
    q_probs_ptr,  # [batch, k, m] float
    temperature_ptr,  # [batch] float
    top_p_ptr,  # [batch] float
    top_k_ptr,  # [batch] int
    uniforms_ptr,  # [batch, k] float
    exponentials_ptr,  # [batch, vocab] float
    num_draft_ptr,  # [batch] int64
    accept_ptr,  # out [batch, k+1] int8: row j's draft token passes (0 at j >= num_draft)
    candidate_ptr,  # out [batch, k+1] int64: the recovered / bonus / greedy token if the block stops at j
    k, vocab, m,
    greedy_temperature,
    BLOCK: tl.constexpr, M_PAD: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):
    """One program per (request, row): acceptance of row j's draft token and row j's candidate."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    k_plus_1 = k + 1
    row_ptr = logits_ptr + (b * k_plus_1 + j).to(tl.int64) * vocab
    num_draft = tl.load(num_draft_ptr + b)
    has_draft = j < num_draft  # scalar: a draft token sits at this row (else: bonus row or padding)
    draft = tl.load(draft_ptr + b * k + j, mask=j < k, other=-1)  # scalar int64 d_{j+1}
    temperature = tl.load(temperature_ptr + b).to(tl.float32)
    safe_temperature = tl.where(temperature < greedy_temperature, 1.0, temperature)

    best_id, row_max, denom, keep_key, keep_id = _row_distribution(
        row_ptr, vocab, temperature, safe_temperature, greedy_temperature, top_p_ptr + b, top_k_ptr + b,
        BLOCK=BLOCK, NUM_PIVOTS=NUM_PIVOTS,
    )
    accept = has_draft & (best_id.to(tl.int64) == draft)
    candidate = best_id.to(tl.int64)
    if temperature >= greedy_temperature:  # a sampled row
        # q_j on its m ids (none at the bonus row or past the block: q is then zero).
        m_offs = tl.arange(0, M_PAD)  # [M_PAD]
        q_row = (b * k + j).to(tl.int64) * m
        q_mask = m_offs < tl.where(has_draft, m, 0)  # [M_PAD]
        q_ids = tl.load(q_ids_ptr + q_row + m_offs, mask=q_mask, other=-1)  # [M_PAD] int64
        q_probs = tl.load(q_probs_ptr + q_row + m_offs, mask=q_mask, other=0.0).to(tl.float32)  # [M_PAD]

        # Acceptance test of d_{j+1}: p(d) > 0 and u * q(d) <= p(d).
        safe_draft = tl.where(has_draft, draft, 0)
        s_draft = tl.load(row_ptr + safe_draft).to(tl.float32) / safe_temperature
        draft_kept = _is_kept(_order_key(s_draft), safe_draft, keep_key, keep_id)
        p_draft = tl.where(draft_kept, tl.exp(s_draft - row_max) / denom, 0.0)
        q_draft = tl.sum(tl.where(q_ids == draft, q_probs, 0.0), axis=0)
        u = tl.load(uniforms_ptr + b * k + j, mask=has_draft, other=1.0).to(tl.float32)
        accept = has_draft & (p_draft > 0) & (u * q_draft <= p_draft)

        # Race pass: argmax of residual / E (the recovered token; the bonus when q is zero), with
        # the race over p / E alongside for a residual that rounds to zero everywhere (p == q).
        race = tl.full([], -1.0, tl.float32)
        race_id = tl.zeros([], tl.int32)
        p_race = tl.full([], -1.0, tl.float32)
        p_race_id = tl.zeros([], tl.int32)
        any_residual = tl.zeros([], tl.int32)  # 1 once some residual is > 0
        e_row = exponentials_ptr + b.to(tl.int64) * vocab
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)  # [BLOCK]
            in_vocab = offs < vocab  # [BLOCK]
            s = _scaled_tile(row_ptr, offs, vocab, safe_temperature)  # [BLOCK]
            kept = _is_kept(_order_key(s), offs, keep_key, keep_id) & in_vocab  # [BLOCK]
            p = tl.where(kept, tl.exp(s - row_max) / denom, 0.0)  # [BLOCK]
            q = tl.sum(tl.where(offs[:, None] == q_ids[None, :], q_probs[None, :], 0.0), axis=1)  # [BLOCK]
            residual = tl.maximum(p - q, 0.0)  # [BLOCK]
            e = tl.load(e_row + offs, mask=in_vocab, other=1.0).to(tl.float32)  # [BLOCK]
            key = tl.where(in_vocab, residual / e, -1.0)  # [BLOCK]
            tile_best = tl.max(key, axis=0)
            take = tile_best > race
            race_id = tl.where(take, start + tl.argmax(key, axis=0), race_id)
            race = tl.where(take, tile_best, race)
            p_key = tl.where(in_vocab, p / e, -1.0)  # [BLOCK]
            tile_best = tl.max(p_key, axis=0)
            take = tile_best > p_race
            p_race_id = tl.where(take, start + tl.argmax(p_key, axis=0), p_race_id)
            p_race = tl.where(take, tile_best, p_race)
            any_residual = tl.maximum(any_residual, (tl.max(residual, axis=0) > 0).to(tl.int32))
        candidate = tl.where(any_residual > 0, race_id, p_race_id).to(tl.int64)

    tl.store(accept_ptr + b * k_plus_1 + j, accept.to(tl.int8))
    tl.store(candidate_ptr + b * k_plus_1 + j, candidate)


@triton.jit
def _commit_kernel(
    accept_ptr,  # [batch, k+1] int8
    candidate_ptr,  # [batch, k+1] int64
    num_accepted_ptr,  # out [batch] int64
    next_token_ptr,  # out [batch] int64
    k,
    K_PAD: tl.constexpr,
):
    """One program per request: the accepted count (leading accepts) and the token after them."""
    b = tl.program_id(0)
    offs = tl.arange(0, K_PAD)  # [K_PAD]
    accept = tl.load(accept_ptr + b * (k + 1) + offs, mask=offs < k + 1, other=0)  # [K_PAD]
    # The first rejected row; row k never accepts (no draft token there), so one always exists.
    first_reject = tl.min(tl.where(accept == 0, offs, K_PAD), axis=0)
    tl.store(num_accepted_ptr + b, first_reject.to(tl.int64))
    tl.store(next_token_ptr + b, tl.load(candidate_ptr + b * (k + 1) + first_reject))


def verify_chain(
    target_logits: torch.Tensor,  # [batch, k+1, vocab], any float dtype
    draft_token_ids: torch.Tensor,  # [batch, k] int64
    q_ids: torch.Tensor,  # [batch, k, m] int64, support of q_j (padding: any valid id with prob 0)
    q_probs: torch.Tensor,  # [batch, k, m] float, q_j on q_ids (padding: 0)
    temperature: torch.Tensor,  # [batch] float
    top_p: torch.Tensor,  # [batch] float
    top_k: torch.Tensor,  # [batch] int
    uniforms: torch.Tensor,  # [batch, k] float on (0, 1], one acceptance test per draft token
    exponentials: torch.Tensor,  # [batch, vocab] float > 0, Exp(1) draws for the recovered/bonus token
    num_draft_tokens: torch.Tensor | None = None,  # [batch] int64 in [0, k]; None = all k
) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch] int64 num_accepted, [batch] int64 next_token)
    """Triton twin of ``kernels.reference.verify_chain`` (same arguments, same results)."""
    batch, k_plus_1, vocab = target_logits.shape
    k = k_plus_1 - 1
    device = target_logits.device
    if num_draft_tokens is None:
        num_draft_tokens = torch.full((batch,), k, dtype=torch.long, device=device)  # [batch]
    m = q_ids.shape[-1] if k > 0 else 1
    num_accepted = torch.empty(batch, dtype=torch.long, device=device)  # [batch]
    next_token = torch.empty(batch, dtype=torch.long, device=device)  # [batch]
    if batch == 0:
        return num_accepted, next_token
    accept = torch.empty(batch, k_plus_1, dtype=torch.int8, device=device)  # [batch, k+1]
    candidate = torch.empty(batch, k_plus_1, dtype=torch.long, device=device)  # [batch, k+1]
    # k == 0 (a plain sampling step) still needs valid pointers for the draft-side inputs.
    if k == 0:
        draft_token_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [batch, 1]
        q_ids = torch.zeros(batch, 1, 1, dtype=torch.long, device=device)  # [batch, 1, 1]
        q_probs = torch.zeros(batch, 1, 1, device=device)  # [batch, 1, 1]
        uniforms = torch.ones(batch, 1, device=device)  # [batch, 1]
    m_pad = triton.next_power_of_2(m)
    block = min(MAX_BLOCK, triton.next_power_of_2(vocab), max(64, MAX_TILE_COMPARES // max(m_pad, NUM_PIVOTS)))
    _verify_rows_kernel[(batch, k_plus_1)](
        target_logits.contiguous(),
        draft_token_ids.contiguous(),
        q_ids.contiguous(),
        q_probs.contiguous(),
        temperature.contiguous(),
        top_p.contiguous(),
        top_k.contiguous(),
        uniforms.contiguous(),
        exponentials.contiguous(),
        num_draft_tokens.to(torch.long).contiguous(),
        accept,
        candidate,
        k, vocab, m,
        GREEDY_TEMPERATURE,
        BLOCK=block, M_PAD=m_pad, NUM_PIVOTS=NUM_PIVOTS,
        num_warps=8 if block >= 1024 else 4,
    )
    # At least 16 wide, so that every block of up to 15 draft tokens shares one compiled variant.
    k_pad = max(16, triton.next_power_of_2(k_plus_1))
    _commit_kernel[(batch,)](accept, candidate, num_accepted, next_token, k, K_PAD=k_pad)
    return num_accepted, next_token
