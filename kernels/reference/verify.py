"""Chain verification of draft blocks (PyTorch reference; a Triton kernel will share the signature).

A draft proposes a block of k tokens ``d_1..d_k`` after a committed prefix. The target runs one
forward pass over ``[last committed token, d_1, .., d_k]`` and gets k+1 rows of logits: row j
(0-based) is the target's next-token distribution after ``d_1..d_j``. Call ``p_j`` the target
distribution of row j (``sampling.target_probs``) and ``q_j`` the draft's proposal distribution for
``d_{j+1}`` (sparse: the draft samples from its renormalised top-m; a deterministic drafter, like
prompt lookup or a greedy draft, has the one-hot ``q_j = [d_{j+1}]``).

Vocabulary (shared with the Triton kernels and the services):

- **accepted** draft token: ``d_{j+1}`` is accepted with probability ``min(1, p_j(d) / q_j(d))``,
  implemented as ``p_j(d) > 0 and u_j * q_j(d) <= p_j(d)`` with ``u_j`` uniform on (0, 1]. The
  accepted tokens are the longest prefix of the block whose tests all pass.
- **recovered** token: after the first rejection, at row j, a token drawn from
  ``norm(max(0, p_j - q_j))`` replaces ``d_{j+1}``. Together with the acceptance rule this makes the
  committed token at every position distributed exactly as p (speculative sampling, Leviathan et
  al. 2023; Chen et al. 2023), whatever q is.
- **bonus** token: when the whole block is accepted, a token drawn from ``p_k`` (the last row).

So a block commits ``num_accepted`` draft tokens plus exactly one recovered or bonus token.

Greedy requests (temperature 0) use argmax instead: accept while ``argmax(row j) == d_{j+1}``; the
extra token is the argmax at the first mismatch (a correction) or at row k (the bonus). This is
the same rule as above with one-hot p, and uses no randomness.

Blocks of different lengths share a batch by padding to k and passing ``num_draft_tokens``.
"""

from __future__ import annotations

import torch

from kernels.reference.sampling import exponential_race, is_greedy, target_probs


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
    """Verifies a batch of chain blocks; returns the accepted count and the recovered-or-bonus token.

    Row b commits ``draft_token_ids[b, :num_accepted[b]]`` followed by ``next_token[b]``. Greedy
    rows ignore q, ``uniforms`` and ``exponentials``. All arithmetic is float32.
    """
    batch, k_plus_1, vocab = target_logits.shape
    k = k_plus_1 - 1
    device = target_logits.device
    if num_draft_tokens is None:
        num_draft_tokens = torch.full((batch,), k, dtype=torch.long, device=device)  # [batch]
    present = torch.arange(k, device=device)[None, :] < num_draft_tokens[:, None]  # [batch, k]
    argmax = target_logits.argmax(dim=-1)  # [batch, k+1]
    greedy_ok = argmax[:, :k] == draft_token_ids  # [batch, k]
    greedy = is_greedy(temperature)  # [batch]
    if bool(greedy.all()):
        # All-greedy batch (the common case): p is one-hot, so nothing over the vocabulary is needed
        # beyond the argmax; same result as the general path below.
        num_accepted = (greedy_ok & present).long().cumprod(dim=-1).sum(dim=-1)  # [batch]
        return num_accepted, argmax.gather(1, num_accepted[:, None])[:, 0]

    p = target_probs(target_logits, temperature, top_p, top_k)  # [batch, k+1, vocab]
    draft_index = draft_token_ids[..., None]  # [batch, k, 1]
    p_draft = p[:, :k].gather(-1, draft_index)[..., 0]  # [batch, k]
    # q is sparse: q_j(d_{j+1}) sums its entries on the draft token; no dense q is built.
    q_draft = ((q_ids == draft_index) * q_probs.float()).sum(dim=-1)  # [batch, k]
    sampled_ok = (p_draft > 0) & (uniforms.float() * q_draft <= p_draft)  # [batch, k]
    ok = torch.where(greedy[:, None], greedy_ok, sampled_ok) & present  # [batch, k]
    num_accepted = ok.long().cumprod(dim=-1).sum(dim=-1)  # [batch]

    # The row of the recovered (first rejection) or bonus (all accepted) token. A bonus row draws
    # from p alone, so q's row is read at the first rejection only (clamped where there is none).
    row = num_accepted[:, None, None].expand(batch, 1, vocab)  # [batch, 1, vocab]
    p_row = p.gather(1, row)[:, 0]  # [batch, vocab]
    q_row = torch.zeros(batch, vocab, dtype=torch.float32, device=device)  # [batch, vocab]
    if k > 0:
        at = num_accepted.clamp(max=k - 1)[:, None, None].expand(-1, 1, q_ids.shape[-1])  # [batch, 1, m]
        q_row.scatter_add_(-1, q_ids.gather(1, at)[:, 0], q_probs.float().gather(1, at)[:, 0])
    is_bonus = num_accepted == num_draft_tokens  # [batch]
    residual = torch.where(is_bonus[:, None], p_row, (p_row - q_row).clamp_min(0.0))  # [batch, vocab]
    # An all-zero residual means p == q on this row, where a rejection has probability 0; only
    # float rounding gets here, and p is then the right distribution to draw from.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_row)  # [batch, vocab]
    sampled_token = exponential_race(residual, exponentials.float())  # [batch]
    greedy_token = argmax.gather(1, num_accepted[:, None])[:, 0]  # [batch]
    next_token = torch.where(greedy, greedy_token, sampled_token)  # [batch]
    return num_accepted, next_token
