"""Token sequences as chained hashes of fixed-size blocks: how a prefix is found without comparing
whole sequences.

Block i's hash covers every token up to the end of block i, so two sequences share the hash of
block i exactly when (hash collisions aside) they share their first ``(i + 1) * BLOCK`` tokens. The
target's prefix cache indexes its entries by them; the gateway remembers by them which target holds
which prompts (``target_service.prefix_cache``, ``gateway.prefix_affinity``).
"""

from __future__ import annotations

from collections.abc import Sequence

BLOCK = 16  # tokens per block


def block_hashes(tokens: Sequence[int]) -> list[int]:
    """One hash per whole block of ``tokens``, each covering every token before its block's end."""
    hashes, previous = [], 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        previous = hash((previous, tuple(tokens[start : start + BLOCK])))
        hashes.append(previous)
    return hashes
