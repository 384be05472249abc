"""KV compaction after a tree verdict (PyTorch reference; ``kernels.compact_kv`` is its kernel).

A tree verify pass appends the keys and values of all n draft nodes after the committed prefix:
node i sits at cache position ``base_len + i - 1``. The verdict accepts a root-to-node path
``a_1 < a_2 < .. < a_j`` (``verify_tree``'s ``accepted_nodes``); the cache must then hold the
prefix followed by exactly those nodes, in order, so the entry at ``base_len + a_i - 1`` moves to
``base_len + i - 1`` in every layer's K and V. Positions past ``base_len + j`` keep stale entries
for the caller to cut off (``target_service.kv_cache.truncate``). Since ``a_i >= i`` an entry only
ever moves towards the prefix; the copy reads every source before writing any destination.

A chain verdict needs no compaction (its accepted nodes are ``1..j`` already in place).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def compact_kv(
    caches: Sequence[torch.Tensor],  # each [batch, kv_heads, seq, head_dim]: every layer's K and V
    base_len: torch.Tensor,  # [batch] int64, cache position of tree node 1
    accepted_nodes: torch.Tensor,  # [batch, n] int64, the accepted path (node ids, -1 past it)
    num_accepted: torch.Tensor,  # [batch] int64
) -> None:
    """Moves each request's accepted path into place right after its prefix, in place, all layers."""
    for b in range(accepted_nodes.shape[0]):
        j = int(num_accepted[b])
        if j == 0:
            continue
        source = int(base_len[b]) + accepted_nodes[b, :j] - 1  # [j]
        target = int(base_len[b]) + torch.arange(j, device=source.device)  # [j]
        for cache in caches:
            cache[b, :, target] = cache[b, :, source]  # the right side is gathered (a copy) first
