"""Locally typical sampling (``typical_p``, Meister et al. 2022; Hugging Face's, llama.cpp's, ollama's).

After the temperature, a row keeps the tokens whose surprisal ``-log p_i`` is closest to the row's
entropy ``H = -sum p log p``: sorted by ``|-log p_i - H|`` ascending, the smallest prefix whose mass
reaches ``typical_p`` (Hugging Face's rule; tokens tied with the last one kept stay too). Unlike
top-p and min_p, it may drop the most probable token (where it is far more probable than typical).
It comes after min_p (on what min_p kept, renormalised) and before top-k and top-p.

The set is found without sorting the row, as top-p is (``kernels.reference.sampling.bucketed_prefix``):
the distances fall into ``BUCKETS`` buckets of equal width, the buckets' masses are summed from the nearest until
they reach ``typical_p``, and only the bucket where they do is sorted. A bucket is monotone in the
distance, so that is the full sort's prefix; the two differ only in float rounding of the masses
(float32 within a bucket, float64 across buckets).

Greedy sessions skip it, as Hugging Face's ``generate`` does without sampling. Speculation keeps the
cut distribution as it keeps a grammar's (the verifier's rules on the cut logits); log-probabilities
stay the model's own.
"""

from __future__ import annotations

import torch

from kernels.reference.sampling import BUCKETS, bucketed_prefix

# Distances beyond this share the last bucket: a float32 probability is 0 below exp(-104), and the
# entropy is at most ln(vocab) (12.5 for 262,144 tokens), so every token with mass is nearer.
SPAN = 120.0


def masked(logits: torch.Tensor, temperature: float, typical_p: float) -> torch.Tensor:
    """``logits`` [rows, vocab] with every token outside its row's typical set at -inf (a copy;
    ``0 < typical_p < 1``, ``temperature > 0``)."""
    logits = logits.float()  # [rows, vocab]
    kept = torch.stack([_typical(row / temperature, typical_p) for row in logits])  # [rows, vocab]
    return torch.where(kept, logits, float("-inf"))  # [rows, vocab]


def _typical(scaled: torch.Tensor, typical_p: float) -> torch.Tensor:
    """Which tokens of one row (``scaled``: [vocab] float32, the temperature applied) are in its typical set."""
    top = scaled.max()
    if not bool(top.isfinite()):
        return torch.zeros_like(scaled, dtype=torch.bool)  # nothing left to keep (or a broken row)
    weights = (scaled - top).exp_()  # [vocab]
    total = weights.sum()
    probs = weights.div_(total)  # [vocab]
    logp = scaled - (top + total.log())  # [vocab], -inf where masked
    entropy = -(probs * logp).nansum()  # masked tokens: 0 * -inf, skipped
    distance = (logp + entropy).abs_()  # [vocab], +inf where masked
    scale = BUCKETS / min(max(float(distance.max()), 1e-30), SPAN)
    bucket = (distance * scale).clamp_(max=BUCKETS - 1).to(torch.int32)  # [vocab]: beyond SPAN, the last
    _, last = bucketed_prefix(bucket, probs, distance, typical_p)
    return distance <= distance[last]  # ties with the last token stay; masked tokens (+inf) never


__all__ = ["masked"]
