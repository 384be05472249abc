"""Tree attention (PyTorch reference; ``kernels.tree_attention`` is its kernel).

A verify pass feeds the target a block of ``n_q`` tokens after a session's committed prefix: a
chain (the root, i.e. the last committed token, then k draft tokens) or a tree of drafts. Each
block token must attend to what it would see if its own root-to-node path were run as a chain:
the whole prefix, plus its ancestors in the block and itself.

Layout (the one transformers hands an attention function after ``cache.update``): the keys and
values of row b hold its prefix at positions ``[0, prefix_len[b])`` and the block's own entries,
in node order, at ``[prefix_len[b], prefix_len[b] + n_q)``; anything after that is padding and is
never read. Without ``prefix_lens`` every row's prefix is ``kv_len - n_q`` (the HF case).

The tree is a parents array ``[n_q]`` (or ``[batch, n_q]``, one tree per row): ``parents[i]`` is
the block index of node i's parent, ``-1`` for a root (a root attends to the prefix and itself);
parents precede their children. A chain is ``[-1, 0, 1, ..]``, the default. Node i sits at the
absolute position ``prefix_len + depth(i)`` (its position in the chain of its path), which is what
RoPE and the sliding window see: a query at position p sees keys at positions ``> p - window``.
A prefix key's position is its index.

Scores are ``scale * q.k``, optionally soft-capped (``softcap * tanh(s / softcap)``, Gemma 2),
masked, softmaxed in float32; the output has q's dtype.
"""

from __future__ import annotations

import torch


def parents_table(
    parents: torch.Tensor | list | tuple | None, n_q: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The parents array as int64 ``[rows, n_q]`` (rows = 1 for a shared tree); None is a chain."""
    if device is None:
        device = parents.device if isinstance(parents, torch.Tensor) else "cpu"
    if parents is None:
        return (torch.arange(n_q, device=device) - 1)[None]  # [1, n_q]
    tree = torch.as_tensor(parents, dtype=torch.long, device=device)
    tree = tree[None] if tree.dim() == 1 else tree  # [rows, n_q]
    if tree.dim() != 2 or tree.shape[-1] != n_q:
        raise ValueError(f"parents must be [n_q] or [batch, n_q] with n_q = {n_q}, got shape {tuple(tree.shape)}")
    index = torch.arange(n_q, device=device)  # [n_q]
    if bool(((tree < -1) | (tree >= index)).any()):
        raise ValueError("parents[i] must be -1 (a root) or a node index in [0, i): parents precede children")
    return tree


def ancestor_mask(parents: torch.Tensor | list | tuple | None, n_q: int | None = None) -> torch.Tensor:
    """``[rows, n_q, n_q]`` bool: entry (i, j) says node j is node i itself or one of its ancestors.

    Row i is its parent's row plus i itself; parents precede children, so one pass in node order
    fills every row. A chain (``None``) is the lower triangle.
    """
    if parents is None:
        return torch.ones(n_q, n_q, dtype=torch.bool).tril()[None]  # [1, n_q, n_q]
    tree = parents_table(parents, torch.as_tensor(parents).shape[-1] if n_q is None else n_q)  # [rows, n_q]
    rows, n_q = tree.shape
    mask = torch.eye(n_q, dtype=torch.bool, device=tree.device).repeat(rows, 1, 1)  # [rows, n_q, n_q]
    every_row = torch.arange(rows, device=tree.device)  # [rows]
    for i in range(n_q):
        parent = tree[:, i]  # [rows]
        inherited = mask[every_row, parent.clamp_min(0)] & (parent >= 0)[:, None]  # [rows, n_q]
        mask[:, i] |= inherited
    return mask


def tree_depths(parents: torch.Tensor | list | tuple | None, n_q: int | None = None) -> torch.Tensor:
    """``[rows, n_q]`` int64: each node's depth (a root's is 0); its position is ``prefix_len + depth``."""
    return ancestor_mask(parents, n_q).sum(-1) - 1


def tree_attention_mask(
    parents: torch.Tensor | list | tuple | None,
    n_q: int,
    kv_len: int,
    prefix_lens: torch.Tensor | None = None,  # [batch] int; None = kv_len - n_q
    sliding_window: int | None = None,
    batch: int = 1,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``[batch, n_q, kv_len]`` bool: which keys each block token attends to (True = attend)."""
    tree = parents_table(parents, n_q, device) if parents is not None else None  # [rows, n_q]
    if prefix_lens is None:
        prefix_lens = torch.full((batch,), kv_len - n_q, dtype=torch.long, device=device)  # [batch]
    prefix = prefix_lens.to(device=device, dtype=torch.long)  # [batch]
    if bool((prefix < 0).any()) or bool((prefix + n_q > kv_len).any()):
        raise ValueError(f"every prefix_len must lie in [0, kv_len - n_q] = [0, {kv_len - n_q}]")
    ancestors = ancestor_mask(tree, n_q).to(device).expand(batch, n_q, n_q)  # [batch, n_q, n_q]
    depth = ancestors.sum(-1) - 1  # [batch, n_q]
    key = torch.arange(kv_len, device=device)  # [kv_len]
    block_index = key[None] - prefix[:, None]  # [batch, kv_len]: node index of a block key
    in_prefix = block_index < 0  # [batch, kv_len]
    in_block = (block_index >= 0) & (block_index < n_q)  # [batch, kv_len]
    node = block_index.clamp(0, n_q - 1)  # [batch, kv_len]
    visible_node = ancestors.gather(2, node[:, None, :].expand(batch, n_q, kv_len))  # [batch, n_q, kv_len]
    mask = in_prefix[:, None, :] | (in_block[:, None, :] & visible_node)  # [batch, n_q, kv_len]
    if sliding_window is not None and sliding_window > 0:
        query_pos = prefix[:, None] + depth  # [batch, n_q]
        key_pos = torch.where(in_prefix, key[None], prefix[:, None] + depth.gather(1, node))  # [batch, kv_len]
        mask &= key_pos[:, None, :] > query_pos[:, :, None] - sliding_window
    return mask


def tree_attention(
    q: torch.Tensor,  # [batch, q_heads, n_q, head_dim]: the block's queries, node order
    k: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]: prefix, then the block's own keys
    v: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    parents: torch.Tensor | list | tuple | None = None,  # [n_q] or [batch, n_q] int; None = chain
    prefix_lens: torch.Tensor | None = None,  # [batch] int; None = kv_len - n_q for every row
    *,
    scale: float | None = None,  # None = head_dim ** -0.5
    sliding_window: int | None = None,  # None or 0 = full attention
    softcap: float | None = None,  # None or 0 = no soft cap
) -> torch.Tensor:  # [batch, q_heads, n_q, head_dim], q's dtype
    """Attention of the block's tokens over prefix + block under the ancestor mask (see module doc)."""
    batch, q_heads, n_q, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    group = q_heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    mask = tree_attention_mask(parents, n_q, kv_len, prefix_lens, sliding_window, batch, q.device)  # [batch, n_q, kv]
    # Padding after a row's block is never read: zeroed, so that even NaN there cannot leak in.
    used = mask.any(dim=1)[:, None, :, None]  # [batch, 1, kv_len, 1]
    keys = torch.where(used, k.float(), 0.0).repeat_interleave(group, dim=1)  # [batch, q_heads, kv_len, head_dim]
    values = torch.where(used, v.float(), 0.0).repeat_interleave(group, dim=1)  # [batch, q_heads, kv_len, head_dim]
    scores = scale * (q.float() @ keys.transpose(-1, -2))  # [batch, q_heads, n_q, kv_len]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))  # every row keeps at least itself
    return (torch.softmax(scores, dim=-1) @ values).to(q.dtype)  # [batch, q_heads, n_q, head_dim]
