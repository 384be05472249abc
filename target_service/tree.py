"""Verification of a token tree: which path the target takes, and the cache it leaves.

A chain block bets every draft on one continuation. A tree block spends the same pass on several:
on a CPU a pass over up to ~6 rows costs what one row costs (the weights are read once either
way), so siblings for the positions where the drafter is unsure are nearly free. The block's
``draft_parents`` name each draft's parent: an earlier draft's index, or -1 for the last committed
token (the root). One pass runs the root and every draft under the ancestor mask, each at position
``root + depth`` (``target_service.ragged`` with ``parents``), so row i is the target's choice after
the path root -> ... -> draft i, exactly what a chain of that path would give.

The verdict walks from the root: the target chooses its token at the current node (greedy: the
row's argmax; sampling: a draw from the row's distribution, fresh for each row walked), the child
holding that token is accepted, and so on; the first node without such a child gives the next
token (its own row's choice: the recovered token, or the bonus at a leaf). Every committed token is
thus exactly the target's own choice after the committed tokens before it, whatever the tree:
greedy output is the target's greedy decoding, and sampled output has the target's distribution
(the tree's drafts are deterministic guesses, so a node's children are accepted with the
probability the target gives them, the most any set of deterministic guesses can get). The pass appended every node to the cache; :func:`keep_path` moves the accepted
path's entries right after the root and the engine's usual truncation drops the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from kernels.reference.compact_kv import compact_kv
from tandem.rpc.token_tree import ROOT, depths


def forward_parents(draft_parents: Sequence[int]) -> tuple[int, ...]:
    """The parents of the pass's rows ``[root, *drafts]``: the root has none (-1), draft i sits at
    row i + 1 and its parent at row ``parent + 1`` (the root for ``ROOT``)."""
    return (ROOT, *(parent + 1 for parent in draft_parents))


def within_depth(
    tokens: Sequence[int], draft_parents: Sequence[int], max_depth: int
) -> tuple[list[int], list[int]]:
    """The drafts at most ``max_depth`` below the root, parents renumbered. Deeper drafts could only
    be committed past the session's budget; ancestors are shallower, so every kept draft keeps its
    parent."""
    kept: dict[int, int] = {}  # old index -> new index
    out_tokens: list[int] = []
    out_parents: list[int] = []
    for i, (token, parent, depth) in enumerate(zip(tokens, draft_parents, depths(draft_parents))):
        if depth > max_depth:
            continue
        kept[i] = len(out_tokens)
        out_tokens.append(token)
        out_parents.append(ROOT if parent == ROOT else kept[parent])
    return out_tokens, out_parents


def greedy_path(tokens: Sequence[int], draft_parents: Sequence[int], choices: Sequence[int]) -> tuple[list[int], int]:
    """(the accepted drafts' indices, root first, and the next token) from the target's choice at
    each row of the pass (``choices``: ``1 + len(tokens)`` tokens, row 0 the root's)."""
    return walk(tokens, draft_parents, lambda row: int(choices[row]))


def walk(tokens: Sequence[int], draft_parents: Sequence[int], choose: Callable[[int], int]) -> tuple[list[int], int]:
    """(the accepted drafts' indices, root first, and the next token), asking ``choose(row)`` for
    the target's token at each row the walk reaches (row 0 the root's, row i + 1 draft i's), in
    order from the root and once each: a sampled choice draws only for the rows on the path."""
    children: dict[int, dict[int, int]] = {}  # parent -> token -> draft index
    for i, (token, parent) in enumerate(zip(tokens, draft_parents)):
        children.setdefault(parent, {}).setdefault(token, i)
    path: list[int] = []
    node = ROOT
    while True:
        choice = choose(node + 1)
        child = children.get(node, {}).get(choice)
        if child is None:
            return path, choice
        path.append(child)
        node = child


def keep_path(cache: DynamicCache, root_position: int, path: Sequence[int]) -> None:
    """Moves the accepted drafts' keys and values (draft i was written at ``root_position + 1 + i``)
    to the positions right after the root, in every layer; what lies beyond is for the caller to
    truncate. A chain's path is already in place and moves nothing."""
    if list(path) == list(range(len(path))):
        return
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]  # each [1, kv_heads, seq, head_dim]
    device = tensors[0].device
    nodes = torch.tensor([[i + 1 for i in path]], dtype=torch.long, device=device)  # [1, j]: 1-based node ids
    with torch.inference_mode():  # the cache was written by inference-mode passes
        compact_kv(tensors, torch.tensor([root_position + 1], device=device), nodes, torch.tensor([len(path)]))
