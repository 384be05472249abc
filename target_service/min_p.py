"""vLLM's and llama.cpp's ``min_p``: a sampled token is never one far less probable than the best.

After the temperature, a token whose probability is below ``min_p`` times the most probable token's
is dropped, so the cut adapts to the row: a confident row keeps few tokens, a flat one many. Kept
means ``softmax(l / T)_i >= min_p * max_j softmax(l / T)_j``, which is ``l_i >= max(l) + T * ln(min_p)``
on the logits, so the cut needs one max per row and no softmax. It is applied after the session's
other reshapings (its bias, penalties and grammar, on the logits they leave; only typical_p follows
it) and before top-k and top-p, as vLLM orders them: top-k and min_p each keep the row's best
tokens, so their order does not matter; top-p then counts the mass of what min_p kept.

Greedy sessions skip it: the most probable token always stays. Speculation keeps the cut
distribution as it keeps a grammar's (the verifier's rules on the cut logits); log-probabilities stay
the model's own.
"""

from __future__ import annotations

import math

import torch


def masked(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """``logits`` [rows, vocab] with every token below ``min_p`` of its row's best at -inf (a copy;
    ``0 < min_p <= 1``, ``temperature > 0``)."""
    logits = logits.float()  # [rows, vocab]
    floor = logits.amax(dim=-1, keepdim=True) + temperature * math.log(min_p)  # [rows, 1]
    return torch.where(logits >= floor, logits, float("-inf"))  # [rows, vocab]


__all__ = ["masked"]
