"""OpenAI's presence and frequency penalties, applied to every row a session scores.

A token's logit loses ``presence_penalty`` if the generated text holds it and ``frequency_penalty``
for each time it does (the prompt does not count, as in OpenAI's API and vLLM), before temperature,
top-k and top-p. The generated text of a row is the session's generated tokens, then, for row
i + 1 of a block, the drafts on draft i's path: so each row of a chain or token tree is scored as
the one-token step at its position would be, and speculation keeps the penalised distribution
(greedy: its argmax; sampled: the verifier's rules on the penalised logits).

Invariant: ``counts`` holds each token's occurrences in the session's generated tokens (its
continued prompt tokens included), advanced only by committed tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

ROOT = -1


class Penalties:
    """One session's penalties and the counts of its generated tokens."""

    def __init__(self, presence: float, frequency: float, vocab_size: int, device: str,
                 generated: Sequence[int] = ()) -> None:
        self.presence = presence
        self.frequency = frequency
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # [vocab]
        self.advance(generated)

    def advance(self, tokens: Sequence[int]) -> None:
        """Counts newly committed tokens."""
        for token, n in Counter(int(t) for t in tokens).items():
            self.counts[token] += n

    def applied(self, logits: torch.Tensor, drafts: Sequence[int] = (), parents: Sequence[int] | None = None
                ) -> torch.Tensor:
        """A copy of ``logits`` [1 + len(drafts), vocab] penalised: row 0 after the generated tokens,
        row i + 1 after draft i's path as well (``parents``: each draft's parent, an earlier draft's
        index or ``ROOT``; None: a chain)."""
        base = self.presence * (self.counts > 0).float() + self.frequency * self.counts  # [vocab]
        out = logits.float() - base  # [rows, vocab]
        if parents is None:
            parents = [i - 1 if i else ROOT for i in range(len(drafts))]
        for i in range(len(drafts)):
            path: Counter[int] = Counter()
            node = i
            while node != ROOT:
                path[int(drafts[node])] += 1
                node = parents[node]
            for token, n in path.items():
                before = float(self.counts[token])
                extra = self.frequency * n + (self.presence if before == 0 else 0.0)
                out[i + 1, token] -= extra
        return out
