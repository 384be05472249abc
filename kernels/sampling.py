"""One autoregressive draw on the GPU (Triton twin of ``kernels.reference.sample_tokens``).

A plain sampling step is chain verification of an empty block: no draft token, so the token the
verifier commits is the bonus token, the exponential race over p (the argmax for greedy
requests). It runs the same fused kernel (``kernels.verify``) with k = 0, so the autoregressive
path and the speculative path draw from exactly the same p.
"""

from __future__ import annotations

import torch

from kernels.verify import verify_chain


def sample_tokens(
    logits: torch.Tensor,  # [batch, vocab], any float dtype
    temperature: torch.Tensor,  # [batch] float
    top_p: torch.Tensor,  # [batch] float
    top_k: torch.Tensor,  # [batch] int
    exponentials: torch.Tensor,  # [batch, vocab] float, Exp(1) draws (ignored for greedy rows)
) -> torch.Tensor:  # [batch] int64
    """One autoregressive step: a token from p (the argmax for greedy requests)."""
    batch = logits.shape[0]
    device = logits.device
    no_draft = torch.zeros(batch, 0, dtype=torch.long, device=device)  # [batch, 0]
    _, token = verify_chain(
        logits[:, None, :],  # [batch, 1, vocab]
        no_draft,
        no_draft[..., None],  # [batch, 0, 1]
        torch.zeros(batch, 0, 1, device=device),  # [batch, 0, 1]
        temperature,
        top_p,
        top_k,
        torch.ones(batch, 0, device=device),  # [batch, 0]
        exponentials,
    )
    return token  # [batch]
