"""Tree verification in Triton (CUDA path of ``kernels.reference.tree.verify_tree``).

Same signature and semantics as the reference: walk the tree from the root; at each node try its
children in index order (first child, next sibling, ...) against the running target distribution
r; an **accepted** child moves the walk down with ``r = p_child``; a rejected child c makes
``r <- norm(max(0, r - q_c))``; the walk ends with a **recovered** token drawn from r when every
child of the node is rejected, or a **bonus** token drawn from ``p_leaf`` at a leaf.

Two launches:

1. ``_tree_rows_kernel``, one program per (request, node row): everything that defines p on the
   row (argmax, max, softmax denominator, top-k / top-p cut-off; ``kernels.verify._row_distribution``)
   into a few scalars per row. All rows run at once: the walk may need any of them.
2. ``_tree_walk_kernel``, one program per request: the walk itself, which is sequential (each
   acceptance decides the next row), then one pass over the final row for the exponential race.

The walk never materialises r over the vocabulary. ``r = w / S`` where ``w(v) = p(v)`` except on
a small table of touched tokens (the q supports of the node's rejected children) holding their
current w, and ``S`` is the running normaliser: rejecting child c with q_c updates, for each id v
of q_c, ``w(v) <- max(0, w(v) - q_c(v) * S)`` and ``S <- S - sum_v min(w(v), q_c(v) * S)``
(``norm(max(0, r - q))`` written unnormalised; O(m) work, no pass over the vocabulary). A
rejection that would leave no mass (``S <= 0``: r == q up to rounding, where a rejection has
probability 0) leaves r unchanged, as the reference does. The final race reads the row once,
taking w from the table where it has the token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import verify as chain
from kernels.reference.sampling import GREEDY_TEMPERATURE
from kernels.verify import _is_kept, _order_key, _row_distribution, _scaled_tile


@triton.jit(do_not_specialize=["n"])
def _tree_rows_kernel(
    logits_ptr,  # [batch, n+1, vocab] any float dtype
    temperature_ptr,  # [batch] float
    top_p_ptr,  # [batch] float
    top_k_ptr,  # [batch] int
    argmax_ptr,  # out [batch, n+1] int32
    row_max_ptr,  # out [batch, n+1] float32
    denom_ptr,  # out [batch, n+1] float32
    keep_key_ptr,  # out [batch, n+1] int64
    keep_id_ptr,  # out [batch, n+1] int32
    n, vocab,
    greedy_temperature,
    BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):
    """One program per (request, row): the scalars that define p on the row."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    row = b * (n + 1) + i
    temperature = tl.load(temperature_ptr + b).to(tl.float32)
    safe_temperature = tl.where(temperature < greedy_temperature, 1.0, temperature)
    best_id, row_max, denom, keep_key, keep_id = _row_distribution(
        logits_ptr + row.to(tl.int64) * vocab, vocab, temperature, safe_temperature, greedy_temperature,
        top_p_ptr + b, top_k_ptr + b, BLOCK=BLOCK, NUM_PIVOTS=NUM_PIVOTS,
    )
    tl.store(argmax_ptr + row, best_id)
    tl.store(row_max_ptr + row, row_max)
    tl.store(denom_ptr + row, denom)
    tl.store(keep_key_ptr + row, keep_key)
    tl.store(keep_id_ptr + row, keep_id)


@triton.jit
def _p_of(row_ptr, token, safe_temperature, row_max, denom, keep_key, keep_id):
    """p(token) on one row from its scalars (``_row_distribution``)."""
    s = tl.load(row_ptr + token).to(tl.float32) / safe_temperature
    return tl.where(_is_kept(_order_key(s), token, keep_key, keep_id), tl.exp(s - row_max) / denom, 0.0)


@triton.jit(do_not_specialize=["n", "m"])
def _tree_walk_kernel(
    logits_ptr,  # [batch, n+1, vocab] any float dtype
    draft_ptr,  # [batch, n] int64
    parents_ptr,  # [batch, n] int64
    q_ids_ptr,  # [batch, n, m] int64
    q_probs_ptr,  # [batch, n, m] float
    temperature_ptr,  # [batch] float
    uniforms_ptr,  # [batch, n] float
    exponentials_ptr,  # [batch, vocab] float
    num_nodes_ptr,  # [batch] int64
    argmax_ptr, row_max_ptr, denom_ptr, keep_key_ptr, keep_id_ptr,  # [batch, n+1] from _tree_rows_kernel
    num_accepted_ptr,  # out [batch] int64
    accepted_nodes_ptr,  # out [batch, n] int64, pre-filled with -1
    next_token_ptr,  # out [batch] int64
    n, vocab, m,
    greedy_temperature,
    BLOCK: tl.constexpr, T_PAD: tl.constexpr,
):
    """One program per request: the walk down the tree, then the recovered / bonus token."""
    b = tl.program_id(0)
    size = tl.load(num_nodes_ptr + b).to(tl.int32)
    temperature = tl.load(temperature_ptr + b).to(tl.float32)
    sampled = temperature >= greedy_temperature
    safe_temperature = tl.where(sampled, temperature, 1.0)
    rows = b * (n + 1)

    slot = tl.arange(0, T_PAD)  # [T_PAD]
    t_ids = tl.full([T_PAD], -1, tl.int64)  # [T_PAD] touched tokens of the current node
    t_w = tl.zeros([T_PAD], tl.float32)  # [T_PAD] their w
    t_count = tl.zeros([], tl.int32)
    scale = tl.full([], 1.0, tl.float32)  # S: r = w / S
    node = tl.zeros([], tl.int32)
    num_accepted = tl.zeros([], tl.int32)
    walking = tl.full([], 1, tl.int32)
    while walking > 0:
        row_ptr = logits_ptr + (rows + node).to(tl.int64) * vocab
        row_max = tl.load(row_max_ptr + rows + node)
        denom = tl.load(denom_ptr + rows + node)
        keep_key = tl.load(keep_key_ptr + rows + node)
        keep_id = tl.load(keep_id_ptr + rows + node)
        argmax = tl.load(argmax_ptr + rows + node).to(tl.int64)
        t_ids = tl.full([T_PAD], -1, tl.int64)
        t_w = tl.zeros([T_PAD], tl.float32)
        t_count = tl.zeros([], tl.int32)
        scale = tl.full([], 1.0, tl.float32)
        accepted_child = tl.full([], -1, tl.int32)
        for c in range(1, n + 1):  # node c's data sits at index c - 1
            parent = tl.load(parents_ptr + b * n + c - 1, mask=c <= size, other=-1).to(tl.int32)
            if (c <= size) & (parent == node) & (accepted_child < 0):
                token = tl.load(draft_ptr + b * n + c - 1)
                ok = token == argmax  # the greedy rule
                if sampled:
                    # r(token) and q_c(token); then the acceptance test u * q <= r.
                    hit = t_ids == token  # [T_PAD]
                    w_token = tl.where(tl.max(hit.to(tl.int32), axis=0) > 0, tl.sum(tl.where(hit, t_w, 0.0), axis=0),
                                       _p_of(row_ptr, token, safe_temperature, row_max, denom, keep_key, keep_id))
                    r_token = w_token / scale
                    q_token = tl.zeros([], tl.float32)
                    for i in range(0, m):
                        q_id = tl.load(q_ids_ptr + (b * n + c - 1).to(tl.int64) * m + i)
                        q_p = tl.load(q_probs_ptr + (b * n + c - 1).to(tl.int64) * m + i).to(tl.float32)
                        q_token += tl.where(q_id == token, q_p, 0.0)
                    u = tl.load(uniforms_ptr + b * n + c - 1).to(tl.float32)
                    ok = (r_token > 0) & (u * q_token <= r_token)
                    if ok == 0:
                        # r <- norm(max(0, r - q_c)), unnormalised on the table (see the module doc).
                        new_ids = t_ids
                        new_w = t_w
                        new_count = t_count
                        new_scale = scale
                        for i in range(0, m):
                            q_id = tl.load(q_ids_ptr + (b * n + c - 1).to(tl.int64) * m + i)
                            q_p = tl.load(q_probs_ptr + (b * n + c - 1).to(tl.int64) * m + i).to(tl.float32)
                            if q_p > 0:
                                hit = new_ids == q_id  # [T_PAD]
                                known = tl.max(hit.to(tl.int32), axis=0) > 0
                                w_table = tl.sum(tl.where(hit, new_w, 0.0), axis=0)
                                w_p = _p_of(row_ptr, q_id, safe_temperature, row_max, denom, keep_key, keep_id)
                                w_old = tl.where(known, w_table, w_p)
                                w_new = tl.maximum(w_old - q_p * scale, 0.0)
                                append = (slot == new_count) & (known == 0)  # [T_PAD]
                                new_ids = tl.where(append, q_id, new_ids)
                                new_w = tl.where(hit | append, w_new, new_w)
                                new_count += tl.where(known, 0, 1)
                                new_scale -= w_old - w_new
                        if new_scale > 0:
                            t_ids = new_ids
                            t_w = new_w
                            t_count = new_count
                            scale = new_scale
                if ok:
                    accepted_child = c
        if accepted_child >= 0:
            tl.store(accepted_nodes_ptr + b * n + num_accepted, accepted_child.to(tl.int64))
            num_accepted += 1
            node = accepted_child
        else:
            walking = 0

    # The recovered token (from r = w / S) or the bonus token (the table is empty at a leaf).
    next_token = tl.load(argmax_ptr + rows + node).to(tl.int64)
    if sampled:
        row_ptr = logits_ptr + (rows + node).to(tl.int64) * vocab
        row_max = tl.load(row_max_ptr + rows + node)
        denom = tl.load(denom_ptr + rows + node)
        keep_key = tl.load(keep_key_ptr + rows + node)
        keep_id = tl.load(keep_id_ptr + rows + node)
        e_row = exponentials_ptr + b.to(tl.int64) * vocab
        race = tl.full([], -1.0, tl.float32)
        race_id = tl.zeros([], tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)  # [BLOCK]
            in_vocab = offs < vocab  # [BLOCK]
            s = _scaled_tile(row_ptr, offs, vocab, safe_temperature)  # [BLOCK]
            kept = _is_kept(_order_key(s), offs, keep_key, keep_id) & in_vocab  # [BLOCK]
            p = tl.where(kept, tl.exp(s - row_max) / denom, 0.0)  # [BLOCK]
            hit = offs[:, None] == t_ids[None, :]  # [BLOCK, T_PAD]
            touched = tl.max(hit.to(tl.int32), axis=1) > 0  # [BLOCK]
            w = tl.where(touched, tl.sum(tl.where(hit, t_w[None, :], 0.0), axis=1), p)  # [BLOCK]
            e = tl.load(e_row + offs, mask=in_vocab, other=1.0).to(tl.float32)  # [BLOCK]
            key = tl.where(in_vocab, (w / scale) / e, -1.0)  # [BLOCK]
            tile_best = tl.max(key, axis=0)
            take = tile_best > race
            race_id = tl.where(take, start + tl.argmax(key, axis=0), race_id)
            race = tl.where(take, tile_best, race)
        next_token = race_id.to(tl.int64)
    tl.store(num_accepted_ptr + b, num_accepted.to(tl.int64))
    tl.store(next_token_ptr + b, next_token)


def verify_tree(
    target_logits: torch.Tensor,  # [batch, n+1, vocab], any float dtype; row 0 is the root
    draft_token_ids: torch.Tensor,  # [batch, n] int64, token of node i at index i-1
    parents: torch.Tensor,  # [batch, n] int64, parent of node i at index i-1, in [0, i-1]
    q_ids: torch.Tensor,  # [batch, n, m] int64
    q_probs: torch.Tensor,  # [batch, n, m] float
    temperature: torch.Tensor,  # [batch] float
    top_p: torch.Tensor,  # [batch] float
    top_k: torch.Tensor,  # [batch] int
    uniforms: torch.Tensor,  # [batch, n] float on (0, 1]
    exponentials: torch.Tensor,  # [batch, vocab] float > 0
    num_nodes: torch.Tensor | None = None,  # [batch] int64 in [0, n]; None = all n
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # ([batch], [batch, n], [batch]) int64
    """Triton twin of ``kernels.reference.tree.verify_tree`` (same arguments, same results)."""
    batch, n_plus_1, vocab = target_logits.shape
    n = n_plus_1 - 1
    device = target_logits.device
    if num_nodes is None:
        num_nodes = torch.full((batch,), n, dtype=torch.long, device=device)  # [batch]
    num_accepted = torch.empty(batch, dtype=torch.long, device=device)  # [batch]
    accepted_nodes = torch.full((batch, n), -1, dtype=torch.long, device=device)  # [batch, n]
    next_token = torch.empty(batch, dtype=torch.long, device=device)  # [batch]
    if batch == 0:
        return num_accepted, accepted_nodes, next_token
    if n == 0:  # valid pointers for the node-side inputs of a tree with only its root
        draft_token_ids = parents = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [batch, 1]
        q_ids = torch.zeros(batch, 1, 1, dtype=torch.long, device=device)  # [batch, 1, 1]
        q_probs = torch.zeros(batch, 1, 1, device=device)  # [batch, 1, 1]
        uniforms = torch.ones(batch, 1, device=device)  # [batch, 1]
    m = q_ids.shape[-1]
    logits = target_logits.contiguous()
    stats = dict(
        argmax=torch.empty(batch, n_plus_1, dtype=torch.int32, device=device),  # [batch, n+1]
        row_max=torch.empty(batch, n_plus_1, dtype=torch.float32, device=device),  # [batch, n+1]
        denom=torch.empty(batch, n_plus_1, dtype=torch.float32, device=device),  # [batch, n+1]
        keep_key=torch.empty(batch, n_plus_1, dtype=torch.long, device=device),  # [batch, n+1]
        keep_id=torch.empty(batch, n_plus_1, dtype=torch.int32, device=device),  # [batch, n+1]
    )
    block = min(chain.MAX_BLOCK, triton.next_power_of_2(vocab), max(64, chain.MAX_TILE_COMPARES // chain.NUM_PIVOTS))
    _tree_rows_kernel[(batch, n_plus_1)](
        logits, temperature.contiguous(), top_p.contiguous(), top_k.contiguous(), *stats.values(),
        n, vocab, GREEDY_TEMPERATURE, BLOCK=block, NUM_PIVOTS=chain.NUM_PIVOTS,
        num_warps=8 if block >= 1024 else 4,
    )
    # The table holds the q supports of one node's rejected children: at most n * m tokens.
    t_pad = triton.next_power_of_2(max(1, n * m))
    walk_block = min(chain.MAX_BLOCK, triton.next_power_of_2(vocab), max(16, chain.MAX_TILE_COMPARES // t_pad))
    _tree_walk_kernel[(batch,)](
        logits, draft_token_ids.contiguous(), parents.contiguous(), q_ids.contiguous(), q_probs.contiguous(),
        temperature.contiguous(), uniforms.contiguous(), exponentials.contiguous(),
        num_nodes.to(torch.long).contiguous(), *stats.values(), num_accepted, accepted_nodes, next_token,
        n, vocab, m, GREEDY_TEMPERATURE, BLOCK=walk_block, T_PAD=t_pad,
    )
    return num_accepted, accepted_nodes, next_token
