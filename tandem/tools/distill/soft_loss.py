"""Distillation loss against the target's stored top-k distribution, restricted to the reduced vocabulary."""

from __future__ import annotations

import torch


def soft_cross_entropy(
    logits: torch.Tensor, topk_reduced: torch.Tensor, topk_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [m, reduced]; topk_reduced [m, k] reduced indices (-1 = outside the set); topk_logprobs [m, k].

    The target's top-k probabilities, limited to the set and renormalised, are the soft labels
    (the cross-entropy equals the KL up to a constant). Rows whose choices all fall outside the set
    carry no signal and are skipped. Returns (mean loss, [m] bool: draft argmax == target argmax).
    """
    inside = topk_reduced >= 0  # [m, k]
    weights = topk_logprobs.float().exp() * inside  # [m, k]
    total = weights.sum(-1, keepdim=True)  # [m, 1]
    keep = total.squeeze(-1) > 0
    logq = torch.log_softmax(logits.float(), dim=-1)  # [m, reduced]
    picked = logq.gather(-1, topk_reduced.clamp(min=0))  # [m, k]
    per_row = -(weights / total.clamp(min=1e-12) * picked).sum(-1)  # [m]
    loss = per_row[keep].mean() if keep.any() else logits.sum() * 0.0
    hit = logits.argmax(-1) == topk_reduced[:, 0]
    return loss, hit
