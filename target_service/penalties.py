"""Penalties on repeats, applied to every row a session scores: OpenAI's presence and frequency
penalties, and the repetition penalty of HF transformers, vLLM and TGI.

A token the generated text holds loses ``presence_penalty`` from its logit once and
``frequency_penalty`` for each time it does (the prompt does not count, as in OpenAI's API and
vLLM). A token the prompt or the generated text holds has its logit divided by
``repetition_penalty`` where positive and multiplied by it where negative (CTRL's rule, as those
servers apply it), before the other two; all before temperature, top-k and top-p. The generated
text of a row is the session's generated tokens, then, for row i + 1 of a block, the drafts on
draft i's path: so each row of a chain or token tree is scored as the one-token step at its
position would be, and speculation keeps the penalised distribution (greedy: its argmax; sampled:
the verifier's rules on the penalised logits).

Invariant: ``counts`` holds each token's occurrences in the session's generated tokens (its
continued prompt tokens included) and ``seen`` the tokens of its prompt and generated tokens,
both advanced only by committed tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

ROOT = -1


class Penalties:
    """One session's penalties, the counts of its generated tokens and the tokens it has seen."""

    def __init__(self, presence: float, frequency: float, vocab_size: int, device: str,
                 generated: Sequence[int] = (), repetition: float = 1.0, prompt: Sequence[int] = ()) -> None:
        self.presence = presence
        self.frequency = frequency
        self.repetition = repetition
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # [vocab]
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [vocab]
        self.seen[torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
        self.advance(generated)
        self.seen_ids = self.seen.nonzero().squeeze(1)  # [seen] the seen tokens, in id order

    def advance(self, tokens: Sequence[int]) -> None:
        """Counts newly committed tokens."""
        new = False
        for token, n in Counter(int(t) for t in tokens).items():
            self.counts[token] += n
            new = new or not self.seen[token]
            self.seen[token] = True
        if new:
            self.seen_ids = self.seen.nonzero().squeeze(1)  # [seen]

    def applied(self, logits: torch.Tensor, drafts: Sequence[int] = (), parents: Sequence[int] | None = None
                ) -> torch.Tensor:
        """A copy of ``logits`` [1 + len(drafts), vocab] penalised: row 0 after the generated tokens,
        row i + 1 after draft i's path as well (``parents``: each draft's parent, an earlier draft's
        index or ``ROOT``; None: a chain)."""
        if parents is None:
            parents = [i - 1 if i else ROOT for i in range(len(drafts))]
        paths = [_path(i, drafts, parents) for i in range(len(drafts))]
        base = self.presence * (self.counts > 0).float() + self.frequency * self.counts  # [vocab]
        out = logits.float() - base  # [rows, vocab]
        if self.repetition != 1.0:  # on the seen tokens' columns only (a few hundred of the vocabulary)
            ids = self.seen_ids  # [seen]
            out[:, ids] = self._repeated(logits[:, ids].float()) - base[ids]  # [rows, seen]
            for i, path in enumerate(paths):
                new = [t for t in path if not self.seen[t]]
                out[i + 1, new] = self._repeated(logits[i + 1, new].float()) - base[new]  # [new]
        for i, path in enumerate(paths):
            for token, n in path.items():
                before = float(self.counts[token])
                extra = self.frequency * n + (self.presence if before == 0 else 0.0)
                out[i + 1, token] -= extra
        return out

    def _repeated(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of tokens seen before, repetition-penalised (divided where positive, else multiplied)."""
        return torch.where(logits > 0, logits / self.repetition, logits * self.repetition)


def _path(node: int, drafts: Sequence[int], parents: Sequence[int]) -> Counter[int]:
    """The drafts on the path from the root to ``node``, counted."""
    path: Counter[int] = Counter()
    while node != ROOT:
        path[int(drafts[node])] += 1
        node = parents[node]
    return path
