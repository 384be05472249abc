"""The eagle head's own features for tokens taken as committed before a verdict brings the
target's (a pipelined block's assumption, ``draft_service.pipeline``).

The head drafts from the target's hidden state at the last committed position. Tokens assumed
committed have none yet, so the head rolls its own, as it does inside a block: each step from a
feature and the token at its position predicts the feature one position on. Most assumed tokens
are the head's own drafts, whose predicted features it kept while drafting (``remember``), so the
rollout costs no step for them; the others (lookup's copies, a guessed token) cost one step each,
at most ``MAX_ROLLOUT``. The verdict's real states replace rolled features when they arrive.

Invariant: a feature predicted while drafting is kept under the tokens that follow the anchor
(the last verdict's length) up to the one it produced, so keys stay a few tokens long whatever the
context; the anchor is valid while the tokens before its length are unchanged, and a new anchor
re-keys what extends it.
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
        # Tokens after the anchor, up to the one a feature produced -> that feature [1, hidden].
        self._predicted: dict[tuple[int, ...], torch.Tensor] = {}
        self._anchor: tuple[int, torch.Tensor] | None = None  # (length, [hidden]) of the last verdict

    def remember(self, tokens: Sequence[int], drafts: Sequence[int], feature: torch.Tensor) -> None:
        """The feature [1, hidden] the head predicted for the position before ``drafts[-1]``, the
        drafts following the committed ``tokens`` (nothing to keep before a verdict's anchor)."""
        if self._anchor is None:
            return
        self._predicted[(*tokens[self._anchor[0]:], *drafts)] = feature
        while len(self._predicted) > MAX_PREDICTED:
            del self._predicted[next(iter(self._predicted))]

    def anchor(self, tokens: Sequence[int], feature: torch.Tensor) -> None:
        """A verdict's feature [hidden] for the committed ``tokens``; predictions that extend them
        are kept (re-keyed from the new anchor), the others dropped."""
        kept: dict[tuple[int, ...], torch.Tensor] = {}
        if self._anchor is not None and self._anchor[0] <= len(tokens):
            added = tuple(tokens[self._anchor[0]:])
            kept = {key[len(added):]: f for key, f in self._predicted.items()
                    if len(key) > len(added) and key[: len(added)] == added}
        self._predicted = kept
        self._anchor = (len(tokens), feature)

    def changed_from(self, base_len: int) -> None:
        """The committed tokens from ``base_len`` on may have changed: an anchor past it is void,
        with what was predicted after it."""
        if self._anchor is not None and base_len < self._anchor[0]:
            self.clear()

    def roll(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """The head's own feature [hidden] for the committed ``tokens``: the anchor's, rolled over
        the tokens after it, from the longest run of them the head predicted while drafting
        (None without an anchor, or past ``MAX_ROLLOUT`` steps)."""
        if self._anchor is None:
            return None
        anchor, end = self._anchor[0], len(tokens)
        start, state = anchor, self._anchor[1][None]  # [1, hidden]: produced token start - 1
        for length in range(end, anchor, -1):
            predicted = self._predicted.get(tuple(tokens[anchor:length]))
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
