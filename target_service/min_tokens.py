"""vLLM's ``min_tokens``: a session's first tokens are never a stop token.

The rows whose token would be among the session's first ``min_tokens`` have the logits of its stop
tokens (the model's end-of-sequence tokens unless ``ignore_eos``, and the session's
``stop_token_ids``) set to -inf before its bias, penalties and grammar, so each row of a chain or
token tree is scored as the one-token step at its position would be, and speculation keeps the
masked distribution (greedy: its argmax; sampled: the verifier's rules on the masked logits).
Log-probabilities stay the model's own.

Invariant: row 0 scores the session's token number ``generated`` (counted from 0, like
``max_new_tokens`` counts), row i + 1 the one after draft i's path; only rows numbered below
``min_tokens`` are masked.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

ROOT = -1


def row_numbers(generated: int, rows: int, parents: Sequence[int] | None = None) -> list[int]:
    """The session's token number each of ``rows`` rows scores: ``generated`` for row 0, then one
    more per draft on row i + 1's path (``parents``: each draft's parent, an earlier draft's index or
    ``ROOT``; None: a chain)."""
    numbers = [generated]
    for i in range(rows - 1):
        parent = parents[i] if parents is not None else i - 1  # a chain's first draft: i - 1 == ROOT
        numbers.append((generated if parent == ROOT else numbers[parent + 1]) + 1)
    return numbers


def masked(logits: torch.Tensor, generated: int, min_tokens: int, stop_ids: Collection[int],
           parents: Sequence[int] | None = None) -> torch.Tensor:
    """A float32 copy of ``logits`` [rows, vocab] with ``stop_ids`` at -inf on the rows that score
    one of the session's first ``min_tokens`` tokens."""
    out = logits.float().clone()  # [rows, vocab]
    held = [r for r, n in enumerate(row_numbers(generated, out.shape[0], parents)) if n < min_tokens]
    if held and stop_ids:
        rows = torch.tensor(held, dtype=torch.long, device=out.device)  # [held]
        ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=out.device)  # [stops]
        out[rows.unsqueeze(1), ids.unsqueeze(0)] = float("-inf")  # [held, stops]
    return out
