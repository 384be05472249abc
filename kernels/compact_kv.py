"""KV compaction in one Triton launch for all layers (CUDA path of ``kernels.reference.compact_kv``).

One program per (cache tensor, request, KV head): it gathers the accepted path's rows
``[j, head_dim]`` from their tree positions, waits at a barrier until every thread of the program
has its rows in registers (a destination row can be another row's source: path ``[2, 3]`` moves
node 2 into node 1's slot and node 3 into node 2's), then writes them after the prefix. The layers'
tensors are separate allocations, so the launch gets a table of their base addresses; they must
share shape, strides and dtype (a ``DynamicCache``'s layers do).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_ELEMENT_TYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit(do_not_specialize=["n"])
def _compact_kv_kernel(
    table_ptr,  # [num_tensors] int64: base address of each cache tensor
    base_len_ptr,  # [batch] int64
    accepted_ptr,  # [batch, n] int64
    num_accepted_ptr,  # [batch] int64
    n,
    stride_b, stride_h, stride_s,  # element strides of every cache tensor (head_dim is contiguous)
    head_dim,
    ELEMENT: tl.constexpr, N_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    """One program per (tensor, request, KV head): gather the path's rows, barrier, scatter them."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    cache = tl.load(table_ptr + t).to(tl.pointer_type(ELEMENT))
    head = cache + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    j = tl.load(num_accepted_ptr + b)
    base = tl.load(base_len_ptr + b)
    step = tl.arange(0, N_PAD)  # [N_PAD] position along the path
    on_path = step < j  # [N_PAD]
    node = tl.load(accepted_ptr + b * n + step, mask=on_path, other=1)  # [N_PAD] int64
    dims = tl.arange(0, D_PAD)  # [D_PAD]
    mask = on_path[:, None] & (dims[None, :] < head_dim)  # [N_PAD, D_PAD]
    source = (base + node - 1)[:, None] * stride_s + dims[None, :]  # [N_PAD, D_PAD]
    rows = tl.load(head + source, mask=mask)  # [N_PAD, D_PAD]
    tl.debug_barrier()  # every source is read before any destination is written
    target = (base + step)[:, None] * stride_s + dims[None, :]  # [N_PAD, D_PAD]
    tl.store(head + target, rows, mask=mask)


def compact_kv(
    caches: Sequence[torch.Tensor],  # each [batch, kv_heads, seq, head_dim]: every layer's K and V
    base_len: torch.Tensor,  # [batch] int64, cache position of tree node 1
    accepted_nodes: torch.Tensor,  # [batch, n] int64, the accepted path (node ids, -1 past it)
    num_accepted: torch.Tensor,  # [batch] int64
) -> None:
    """Triton twin of ``kernels.reference.compact_kv`` (same arguments, same effect)."""
    if not caches or accepted_nodes.shape[1] == 0:
        return
    first = caches[0]
    batch, kv_heads, _, head_dim = first.shape
    for cache in caches:
        if cache.shape != first.shape or cache.stride() != first.stride() or cache.dtype != first.dtype:
            raise ValueError("every cache tensor must share shape, strides and dtype")
        if cache.stride(-1) != 1:
            raise ValueError("cache tensors must be contiguous along head_dim")
    table = torch.tensor([cache.data_ptr() for cache in caches], dtype=torch.int64, device=first.device)  # [tensors]
    n = accepted_nodes.shape[1]
    _compact_kv_kernel[(len(caches), batch, kv_heads)](
        table,
        base_len.to(torch.long).contiguous(),
        accepted_nodes.contiguous(),
        num_accepted.to(torch.long).contiguous(),
        n, first.stride(0), first.stride(1), first.stride(2), head_dim,
        ELEMENT=_ELEMENT_TYPES[first.dtype], N_PAD=triton.next_power_of_2(n), D_PAD=triton.next_power_of_2(head_dim),
    )
