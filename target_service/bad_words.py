"""vLLM's ``bad_words``: token sequences the generated text never completes.

The gateway turns each word into the token sequences that spell it (``gateway.token_masks``). For a
sequence ``[t1, ..., tn]``, a row whose generated text ends with ``t1 .. t(n-1)`` has ``tn``'s logit
at -inf; a one-token sequence is banned on every row. Only the generated text counts (a session
continued from an earlier one counts that one's output too), as in vLLM. The mask comes after
min_tokens' and the allowed tokens' masks, before the session's bias, penalties and grammar.

The generated text of a row is the session's generated tokens, then, for row i + 1 of a block, the
drafts on draft i's path: so each row of a chain or token tree is scored as the one-token step at its
position would be, and speculation keeps the masked distribution (greedy: its argmax; sampled: the
verifier's rules on the masked logits). Log-probabilities stay the model's own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

ROOT = -1


class BadWords:
    """A session's banned sequences, grouped by the prefix that must precede their last token."""

    def __init__(self, sequences: Sequence[Sequence[int]], device: str) -> None:
        self.always = torch.tensor(sorted({s[0] for s in sequences if len(s) == 1}), dtype=torch.long,
                                   device=device)  # [singles]
        after: dict[tuple[int, ...], set[int]] = defaultdict(set)
        for sequence in sequences:
            if len(sequence) > 1:
                after[tuple(sequence[:-1])].add(sequence[-1])
        self.after = {prefix: sorted(last) for prefix, last in after.items()}  # prefix -> the tokens it bans
        self.longest = max((len(p) for p in self.after), default=0)

    def masked(self, logits: torch.Tensor, generated: Sequence[int], drafts: Sequence[int] = (),
               parents: Sequence[int] | None = None) -> torch.Tensor:
        """A float32 copy of ``logits`` [1 + len(drafts), vocab] masked: row 0 after the ``generated``
        tokens, row i + 1 after draft i's path as well (``parents``: each draft's parent, an earlier
        draft's index or ``ROOT``; None: a chain)."""
        out = logits.float().clone()  # [rows, vocab]
        out[:, self.always] = float("-inf")
        if not self.after:
            return out
        tail = list(generated[max(len(generated) - self.longest, 0):])
        if parents is None:
            parents = [i - 1 for i in range(len(drafts))]  # a chain: draft 0's parent is ROOT (-1)
        for row in range(out.shape[0]):
            text = tail + _path(row - 1, drafts, parents)
            banned = [t for prefix, last in self.after.items() if _ends_with(text, prefix) for t in last]
            if banned:
                out[row, banned] = float("-inf")
        return out


def _path(node: int, drafts: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The drafts from the root to ``node`` (``ROOT``: none), in order."""
    path = []
    while node != ROOT:
        path.append(int(drafts[node]))
        node = parents[node]
    return path[::-1]


def _ends_with(text: list[int], prefix: tuple[int, ...]) -> bool:
    return len(text) >= len(prefix) and tuple(text[len(text) - len(prefix):]) == prefix


__all__ = ["BadWords"]
