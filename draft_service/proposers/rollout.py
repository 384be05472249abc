"""The eagle head's own features for tokens taken as committed before a verdict brings the
target's (a pipelined block's assumption, ``draft_service.pipeline``).

The head drafts from the target's hidden state at the last committed position. Tokens assumed
committed have none yet, so the head rolls its own, as it does inside a block: each step from a
feature and the token at its position predicts the feature one position on. Most assumed tokens
are the head's own drafts, whose predicted features it kept while drafting (``remember``), so the
rollout costs no step for them; the others (lookup's copies, a guessed token) cost one step each,
at most ``MAX_ROLLOUT``. The verdict's real states replace rolled features when they arrive.

Invariant: a feature belongs to a whole sequence (its key), the one whose last token it produced;
the anchor is the last verdict's, valid while the tokens before its length are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

MAX_ROLLOUT = 8  # head steps a commit without hidden states may take to keep a feature
MAX_PREDICTED = 256  # features predicted while drafting, kept for a rollout (oldest dropped first)

# (feature [1, hidden], token ids [1]) -> (next feature [1, hidden], logits [1, reduced])
HeadStep = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class FeatureRollout:
    def __init__(self, step: HeadStep, device: torch.device) -> None:
        self._step = step
        self._device = device
        self._predicted: dict[tuple[int, ...], torch.Tensor] = {}  # sequence -> [1, hidden]
        self._anchor: tuple[int, torch.Tensor] | None = None  # (length, [hidden]) of the last verdict

    def remember(self, sequence: Sequence[int], feature: torch.Tensor) -> None:
        """The feature [1, hidden] the head predicted for the position before ``sequence[-1]``."""
        self._predicted[tuple(sequence)] = feature
        while len(self._predicted) > MAX_PREDICTED:
            del self._predicted[next(iter(self._predicted))]

    def anchor(self, length: int, feature: torch.Tensor) -> None:
        """A verdict's feature [hidden] for the first ``length`` committed tokens."""
        self._anchor = (length, feature)

    def changed_from(self, base_len: int) -> None:
        """The committed tokens from ``base_len`` on may have changed: an anchor past it is void."""
        if self._anchor is not None and base_len < self._anchor[0]:
            self._anchor = None

    def roll(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """The head's own feature [hidden] for the committed ``tokens``: the anchor's, rolled over
        the tokens after it, from the longest run of them the head predicted while drafting
        (None without an anchor, or past ``MAX_ROLLOUT`` steps)."""
        if self._anchor is None:
            return None
        end = len(tokens)
        start, state = self._anchor[0], self._anchor[1][None]  # [1, hidden]: produced token start - 1
        for length in range(end, start, -1):
            predicted = self._predicted.get(tuple(tokens[:length]))
            if predicted is not None:
                start, state = length, predicted
                break
        if end - start > MAX_ROLLOUT:
            return None
        with torch.inference_mode():
            for position in range(start - 1, end - 1):  # each step predicts the feature one position on
                token_ids = torch.tensor([tokens[position]], dtype=torch.long, device=self._device)  # [1]
                state, _ = self._step(state.to(self._device), token_ids)  # [1, hidden]
        return state[0].detach().float()

    def clear(self) -> None:
        self._predicted = {}
        self._anchor = None
