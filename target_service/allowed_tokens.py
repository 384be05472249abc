"""vLLM's ``allowed_token_ids``: a session generates only these tokens.

Every row the session scores keeps the logits of the allowed ids and has every other at -inf (the
end-of-sequence token too, unless it is allowed: the answer then runs to its budget). It comes
first among the session's reshapings (min_tokens' mask aside, which a session with allowed ids does
not have), so the bias, penalties, min_p and the rest see only allowed tokens.
The mask is the same on every row, so each row of a chain or token tree is scored as the one-token
step at its position would be, and speculation keeps the masked distribution (greedy: its argmax;
sampled: the verifier's rules on the masked logits). Log-probabilities stay the model's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class AllowedTokens:
    """The ids a session may generate, and the mask of the rest."""

    def __init__(self, token_ids: Sequence[int], device: str) -> None:
        self.ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=device)  # [allowed]

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of ``logits`` [rows, vocab] with every id but the allowed ones at -inf."""
        out = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)  # [rows, vocab]
        out[:, self.ids] = logits[:, self.ids].float()
        return out


__all__ = ["AllowedTokens"]
