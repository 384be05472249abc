"""OpenAI's ``logit_bias``: a constant added to the logits of the token ids a request names.

The bias is added to every row a session scores, before its penalties (``target_service.penalties``)
and its grammar's mask, so each row of a chain or token tree is scored as the one-token step at its
position would be, and speculation keeps the biased distribution (greedy: its argmax; sampled: the
verifier's rules on the biased logits). Log-probabilities stay the model's own.

Invariant: ``token_ids`` are distinct, each below the vocabulary size (checked at ``Prefill``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class LogitBias:
    """One session's bias: ``values[i]`` is added to the logit of ``token_ids[i]``."""

    def __init__(self, pairs: Sequence[tuple[int, float]], device: str) -> None:
        self.token_ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device)  # [n]
        self.values = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=device)  # [n]

    def applied(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of ``logits`` [rows, vocab] with the bias added to every row."""
        out = logits.float().clone()  # [rows, vocab]
        out[:, self.token_ids] += self.values  # [rows, n] += [n]
        return out
