"""Sampling a draft token with an exactly sparse proposal distribution q (the ``hf`` and ``eagle``
drafters share it). Free of transformers, so a proposer that needs no model class loads fast.
"""

from __future__ import annotations

import hashlib

import torch

from draft_service.types import SamplingParams, SparseDist


def draft_seed(seed: int) -> int:
    """The draft's generator seed for a session seed.

    Derived rather than reused: the target seeds its own generator from the same session seed, and
    if the draft's samples and the target's acceptance uniforms came from identical streams they
    would be correlated, which breaks the exactness of rejection sampling.
    """
    digest = hashlib.sha256(f"tandem-draft:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TopKSampler:
    """Samples a draft token from the renormalised top-k of the tempered logits and returns q.

    q is exactly sparse (zero outside the kept ids), so the target's rejection sampling is exact
    with it and it stays small on the wire. The session's own top_k / top_p / min_p narrow q further
    when set: tokens the target can never produce would only be rejected. typical_p does not: its set
    depends on the entropy of the target's whole row, which the draft's top-k cannot tell.
    """

    def __init__(self, sampling: SamplingParams, draft_top_k: int) -> None:
        if sampling.temperature <= 0:
            raise ValueError("TopKSampler needs a positive temperature; greedy drafts use argmax")
        self.temperature = sampling.temperature
        self.top_k = min(draft_top_k, sampling.top_k) if sampling.top_k > 0 else draft_top_k
        self.top_p = sampling.top_p if 0.0 < sampling.top_p < 1.0 else 1.0
        self.min_p = sampling.min_p
        self.generator = torch.Generator(device="cpu")
        if sampling.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(draft_seed(sampling.seed))

    def sample(self, logits: torch.Tensor, id_map: torch.Tensor | None = None) -> tuple[int, SparseDist]:
        """logits: [vocab] (already limited to ids the target accepts).

        ``id_map`` ([vocab] int64) translates logit indices to target ids (reduced vocabularies);
        the returned token and q are in target ids.
        """
        k = min(self.top_k, logits.shape[-1])
        values, ids = torch.topk(logits.float() / self.temperature, k)  # [k], [k], descending
        probs = torch.softmax(values.cpu(), dim=-1)  # [k]: the top-k renormalised
        ids = ids.cpu()
        if self.min_p > 0.0:
            # As the target cuts (target_service.min_p), before top-p; the top token always stays.
            keep = probs >= self.min_p * probs[0]  # [k]
            probs, ids = probs[keep], ids[keep]
            probs = probs / probs.sum()
        if self.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            keep = (torch.cumsum(probs, dim=-1) - probs) < self.top_p  # [k]
            probs, ids = probs[keep], ids[keep]
        nonzero = probs > 0  # masked (-inf) logits that topk still returned
        probs, ids = probs[nonzero], ids[nonzero]
        probs = probs / probs.sum()
        choice = int(torch.multinomial(probs, 1, generator=self.generator))
        if id_map is not None:
            ids = id_map[ids.to(id_map.device)].cpu()  # [m] target ids
        dist = SparseDist(tuple(int(i) for i in ids), tuple(float(p) for p in probs))
        return int(ids[choice]), dist


__all__ = ["TopKSampler", "draft_seed"]
