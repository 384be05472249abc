"""Chain verification and sampling one row at a time: the CPU's twin of ``kernels.reference``.

The reference builds p over every row of a block and draws each token by the exponential race over
the whole vocabulary (one Exp(1) draw per token id), which suits a GPU: every row and every id in
parallel, no search. On a CPU the same work is serial and it is most of a sampled step's cost
beyond the model's pass: for gemma-3-270m's 262,144 ids, a block of k drafts paid a softmax and an
argmax over all k + 1 rows and 262,144 random draws for its one recovered or bonus token
(benchmarks/RESULTS.md). Here:

- a sampled block's rows are scored in order and only until the first rejection, since the
  verifier stops there (``p_j`` is ``reference.target_probs`` of row j alone, the same definition);
- the recovered or bonus token is drawn by inverting the cumulative weights (float64) at one
  uniform ``u`` on (0, 1]: token i is drawn when ``c_{i-1} < u * c_last <= c_i``, so with
  probability ``w_i / sum(w)``, and a token of weight 0 never is;
- greedy rows take the argmax of the rows they need, also in order.

Same signatures as the reference, except the last random input: ``draws`` [batch, 1], one uniform
per row (``token_draws``) where the reference takes Exp(1) draws over the vocabulary. So the
committed tokens are distributed exactly as the reference's (the tests compare the two
statistically), but a seed gives other tokens than it does on a GPU (it did already: CPU and CUDA
generators differ).
"""

from __future__ import annotations

import math

import torch

from kernels.reference.sampling import draw_uniforms, is_greedy, target_probs


def token_draws(batch: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """The random input of one drawn token per row: [batch, 1] uniforms on (0, 1]."""
    del vocab_size  # one uniform whatever the vocabulary (the reference needs one draw per id)
    return draw_uniforms((batch, 1), generator)


def draw(weights: torch.Tensor, uniform: torch.Tensor, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """Token i with probability ``weights[i] / weights.sum()``; from ``fallback`` when the weights
    sum to 0 (a residual ``p - q`` that float rounding emptied).

    weights: [vocab] float >= 0; uniform: [1] on (0, 1]. Returns a [] int64 tensor.

    The cumulative weights are summed on two levels, in float64: over chunks of about sqrt(vocab)
    ids, then inside the one chunk the point ``u * total`` falls in (a cumsum over all 262,144 ids
    cost more than the softmax before it). Token i is drawn when ``c_{i-1} < point <= c_i``, the
    chunk's and the token's bounds alike, so a token of weight 0 never is: its bound equals the one
    before it, which takes the point first."""
    vocab = weights.shape[0]
    chunk = math.isqrt(max(vocab - 1, 0)) + 1  # ceil(sqrt(vocab))
    whole = vocab // chunk * chunk
    sums = weights[:whole].reshape(-1, chunk).sum(1, dtype=torch.float64)  # [vocab // chunk]
    if whole < vocab:
        sums = torch.cat([sums, weights[whole:].sum(0, dtype=torch.float64)[None]])  # [chunks]
    cumulative = sums.cumsum(0)  # [chunks]
    if not float(cumulative[-1]) > 0:
        if fallback is None:
            raise ValueError("draw needs some weight above 0")
        return draw(fallback, uniform)
    point = uniform.double()[:1] * cumulative[-1]  # [1] in (0, total]
    c = min(int(torch.searchsorted(cumulative, point)), len(sums) - 1)  # the first chunk whose bound reaches it
    start = c * chunk
    inner = weights[start : start + chunk].double().cumsum(0)  # [<= chunk]
    # Above 0 (the chunk before ends below the point) and at most the chunk's own sum, which its
    # cumsum may round a little under the chunks' bound.
    within = (point - cumulative[c - 1] if c else point).clamp(max=float(inner[-1]))  # [1]
    return torch.tensor(start + min(int(torch.searchsorted(inner, within)), len(inner) - 1))


def verify_chain(
    target_logits: torch.Tensor,  # [batch, k+1, vocab], any float dtype
    draft_token_ids: torch.Tensor,  # [batch, k] int64
    q_ids: torch.Tensor,  # [batch, k, m] int64, support of q_j (padding: any valid id with prob 0)
    q_probs: torch.Tensor,  # [batch, k, m] float, q_j on q_ids (padding: 0)
    temperature: torch.Tensor,  # [batch] float
    top_p: torch.Tensor,  # [batch] float
    top_k: torch.Tensor,  # [batch] int
    uniforms: torch.Tensor,  # [batch, k] float on (0, 1], one acceptance test per draft token
    draws: torch.Tensor,  # [batch, 1] float on (0, 1], the recovered/bonus token's draw (token_draws)
    num_draft_tokens: torch.Tensor | None = None,  # [batch] int64 in [0, k]; None = all k
) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch] int64 num_accepted, [batch] int64 next_token)
    """``kernels.reference.verify_chain``'s rule (accepted, recovered and bonus tokens as defined
    there), each row's work stopping at its first rejection."""
    batch, k_plus_1, _ = target_logits.shape  # [batch, k+1, vocab]
    k = k_plus_1 - 1
    greedy = is_greedy(temperature).tolist()  # [batch]
    counts = [k] * batch if num_draft_tokens is None else num_draft_tokens.tolist()
    accepted_out, next_out = [], []
    for b in range(batch):
        rows, drafts, n = target_logits[b], draft_token_ids[b].tolist(), counts[b]
        if greedy[b]:
            accepted, token = _greedy_chain(rows, drafts, n)
        else:
            params = (temperature[b : b + 1], top_p[b : b + 1], top_k[b : b + 1])
            accepted, token = _sampled_chain(rows, drafts, n, q_ids[b], q_probs[b], params, uniforms[b], draws[b])
        accepted_out.append(accepted)
        next_out.append(token)
    device = target_logits.device
    return (torch.tensor(accepted_out, dtype=torch.long, device=device),
            torch.tensor(next_out, dtype=torch.long, device=device))


def _greedy_chain(rows: torch.Tensor, drafts: list[int], n: int) -> tuple[int, int]:
    """rows: [k+1, vocab]. Drafts accepted while each equals its row's argmax."""
    for j in range(n + 1):
        choice = int(rows[j].argmax())
        if j == n or choice != drafts[j]:
            return j, choice
    raise AssertionError("unreachable")


def _sampled_chain(
    rows: torch.Tensor,  # [k+1, vocab]
    drafts: list[int],  # k
    n: int,  # drafts present
    q_ids: torch.Tensor,  # [k, m]
    q_probs: torch.Tensor,  # [k, m]
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # temperature, top_p, top_k, each [1]
    uniforms: torch.Tensor,  # [k]
    uniform: torch.Tensor,  # [1], the draw of the token committed after the accepted drafts
) -> tuple[int, int]:
    for j in range(n + 1):
        p = target_probs(rows[j][None, None], *params)[0, 0]  # [vocab]
        if j == n:
            return j, int(draw(p, uniform))  # the bonus token: every draft accepted
        d = drafts[j]
        on_draft = q_ids[j] == d  # [m]
        q_d = float((q_probs[j].float() * on_draft).sum())
        p_d = float(p[d])
        if p_d > 0 and float(uniforms[j]) * q_d <= p_d:
            continue
        q_row = torch.zeros_like(p).index_add_(0, q_ids[j], q_probs[j].float())  # [vocab]
        residual = (p - q_row).clamp_min(0.0)  # [vocab]
        # p == q on this row leaves nothing, where a rejection has probability 0 (float rounding only).
        return j, int(draw(residual, uniform, fallback=p))
    raise AssertionError("unreachable")


def sample_tokens(
    logits: torch.Tensor,  # [batch, vocab], any float dtype
    temperature: torch.Tensor,  # [batch] float
    top_p: torch.Tensor,  # [batch] float
    top_k: torch.Tensor,  # [batch] int
    draws: torch.Tensor,  # [batch, 1] float on (0, 1] (token_draws; ignored for greedy rows)
) -> torch.Tensor:  # [batch] int64
    """One autoregressive step: a token from p (the argmax for greedy requests)."""
    tokens = []
    for b, greedy in enumerate(is_greedy(temperature).tolist()):
        if greedy:
            tokens.append(int(logits[b].argmax()))
            continue
        p = target_probs(logits[b][None, None], temperature[b : b + 1], top_p[b : b + 1], top_k[b : b + 1])[0, 0]
        tokens.append(int(draw(p, draws[b])))
    return torch.tensor(tokens, dtype=torch.long, device=logits.device)  # [batch]


__all__ = ["draw", "sample_tokens", "token_draws", "verify_chain"]
