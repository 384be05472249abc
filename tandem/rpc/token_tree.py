"""The token-tree convention both services share (``VerifyRequest.draft_parents``): each draft
names its parent, an earlier draft's index or ``ROOT`` for the last committed token."""

from __future__ import annotations

from collections.abc import Sequence

ROOT = -1  # the parent of a draft that follows the last committed token


def depths(draft_parents: Sequence[int]) -> list[int]:
    """Each draft's depth below the root (1 for a child of the root)."""
    found: list[int] = []
    for parent in draft_parents:
        found.append(1 if parent == ROOT else found[parent] + 1)
    return found
