"""The session's logit shaping, as the eagle head and a model draft (``hf``) draft with it.

The target chooses a penalised or biased session's tokens from reshaped logits: its logit bias,
then the repetition penalty over the prompt and the generated text, then the presence and frequency
penalties over the generated text (``target_service.logit_bias``, ``target_service.penalties``).
A drafter that drafts from its model's own logits proposes what the target has been told to avoid
(the repeats a repetition penalty discourages, a banned token), and those drafts are rejected. So
its logits are reshaped the same way before it picks, ranks or samples its drafts.

Only acceptance depends on this: the target verifies every draft against its own reshaped
distribution, and a sampled draft's q is the distribution it was drawn from, so the committed text
is the same with or without it. One approximation, for speed: the counts are the committed tokens'
only, not those of the drafts earlier in the block being proposed (the target counts them per row).

Invariant: the seen and penalised tokens are those of the sequence last given to :meth:`commit`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from draft_service.types import LogitShaping


class ShapedLogits:
    """One session's shaping over a drafter's (maybe reduced) vocabulary (``vocab_ids`` [reduced]:
    each logit index's target id), updated at each commit and applied to each step's logits."""

    def __init__(self, shaping: LogitShaping, vocab_ids: torch.Tensor) -> None:
        self._shaping = shaping
        device = vocab_ids.device
        self._reduced = torch.full((int(vocab_ids.max()) + 1,), -1, dtype=torch.long, device=device)  # [vocab]
        self._reduced[vocab_ids] = torch.arange(vocab_ids.numel(), device=device)
        # [biased] reduced indices of the biased tokens the head scores, and their biases
        self._bias_ids, self._bias = self._indexed([t for t, _ in shaping.bias], [b for _, b in shaping.bias])
        self._seen_ids = self._bias_ids[:0]  # [seen] reduced indices of the prompt's and generated tokens
        self._penalty_ids = self._bias_ids[:0]  # [generated] reduced indices of the generated tokens ...
        self._penalties = self._bias[:0]  # [generated] ... and what each loses (presence + frequency * count)

    def commit(self, token_ids: Sequence[int]) -> None:
        """Counts the committed sequence (the whole of it, prompt included)."""
        if self._shaping.repetition != 1.0:
            self._seen_ids, _ = self._indexed(sorted(set(token_ids)), [])
        counts = Counter(token_ids[self._shaping.generated_from:])
        presence, frequency = self._shaping.presence, self._shaping.frequency
        self._penalty_ids, self._penalties = self._indexed(list(counts), [presence + frequency * n
                                                                          for n in counts.values()])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of the head's ``logits`` [rows, reduced], shaped as the target's are."""
        out = logits.float().clone()  # [rows, reduced]
        out[:, self._bias_ids] += self._bias  # [rows, biased]
        if self._shaping.repetition != 1.0:
            seen = out[:, self._seen_ids]  # [rows, seen]
            r = self._shaping.repetition
            out[:, self._seen_ids] = torch.where(seen > 0, seen / r, seen * r)
        out[:, self._penalty_ids] -= self._penalties  # [rows, generated]
        return out

    def _indexed(self, tokens: Sequence[int], values: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """The reduced vocabulary's indices of those target ids the head scores ([n] int64), with
        their ``values`` ([n] float32; empty when none are given)."""
        device = self._reduced.device
        ids = torch.tensor(list(tokens), dtype=torch.long, device=device)  # [tokens]
        found = torch.full_like(ids, -1)  # [tokens]
        inside = (ids >= 0) & (ids < self._reduced.numel())  # [tokens]
        found[inside] = self._reduced[ids[inside]]
        kept = found >= 0  # [tokens]
        given = torch.tensor(list(values), dtype=torch.float32, device=device)  # [tokens] or [0]
        return found[kept], given[kept] if len(values) else given
