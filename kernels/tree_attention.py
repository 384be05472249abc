"""Tree attention in Triton (CUDA path of ``kernels.reference.tree_attention.tree_attention``).

Same signature, layout and semantics as the reference (read its module doc first). A verify pass
is a decode step with a few queries: its cost is reading the KV cache, so the kernel is built
around reading every K/V tile exactly once.

- One program per (request, KV head, split). Its query tile is every block token of every query
  head sharing that KV head (GQA): ``M = group * n_q`` rows (row ``r``: head ``r // n_q`` of the
  group, node ``r % n_q``), padded to a power of two >= 16 for ``tl.dot``. Each K/V tile of
  ``BLOCK_N`` keys is loaded once and serves all M rows.
- Online softmax in float32 (base 2: scores are pre-multiplied by log2(e)); the dots run on the
  tensor cores in the inputs' 16-bit type with float32 accumulation, or in float32 for float32
  inputs (and for bf16 under the interpreter, which cannot multiply bf16).
- The mask per (row, key) is computed from two small tables instead of being read from memory:
  ``ancestors[i]``, a 64-bit set of node i's ancestors-or-self, and ``depth[i]``. A key below
  ``prefix_len`` is visible; a block key t is visible when bit t of ``ancestors[i]`` is set; with a
  sliding window both must also lie at a position ``> prefix_len + depth[i] - window`` (a block
  key's position is ``prefix_len + depth[t]``). Keys before the root's window are never loaded.
- Long contexts with fewer (request, KV head) pairs than SMs are cut into splits along the keys
  (flash decoding): each split writes its unnormalised accumulator with its running max and sum,
  and a second launch merges the splits. One split writes the output directly.
- Launch configurations (keys per tile, warps, stages) were chosen by compiling for sm_90 and
  reading ptxas' register and spill counts, not by timing: no GPU was at hand.

Limits: ``n_q <= 64`` (the ancestor set is one int64) and a padded query tile of at most
``MAX_TILE`` elements (``fits``); head_dim is padded to a power of two. float32 inputs run exact
(IEEE) dots: right everywhere, but on a GPU large tiles spill registers (a test path; models run
bf16 there). The output is returned as ``[batch, q_heads, n_q, head_dim]`` but laid out in
memory as ``[batch, n_q, q_heads, head_dim]``, the layout transformers wants back from an
attention function, so ``out.transpose(1, 2)`` is contiguous at no cost.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.reference.tree_attention import parents_table

MAX_QUERIES = 64  # n_q limit: the ancestor set of a node is one int64
MAX_TILE = 256 * 128  # limit on the padded query tile (group * n_q rows x head_dim): its K/V tiles fit shared memory
MIN_KEYS_PER_SPLIT = 512  # a split's partial result (rows x head_dim floats) stays < ~10% of its K/V bytes
_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # a window no context reaches


@triton.jit
def _tree_attention_kernel(
    q_ptr,  # [batch, q_heads, n_q, head_dim]
    k_ptr,  # [batch, kv_heads, kv_len, head_dim]
    v_ptr,  # [batch, kv_heads, kv_len, head_dim]
    out_ptr,  # [batch, q_heads, n_q, head_dim] (strided; written when SPLIT is False)
    prefix_len_ptr,  # [batch] int64 (RAGGED only)
    ancestors_ptr,  # [tree_rows, n_q] int64: bit t = node t is an ancestor-or-self
    depth_ptr,  # [tree_rows, n_q] int32
    part_acc_ptr,  # [batch * kv_heads, splits, M_PAD, D_PAD] float32 (SPLIT only)
    part_max_ptr,  # [batch * kv_heads, splits, M_PAD] float32 (SPLIT only)
    part_sum_ptr,  # [batch * kv_heads, splits, M_PAD] float32 (SPLIT only)
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    tree_stride,  # 0 when every request shares one tree, else n_q
    kv_heads, n_q, head_dim, num_splits, split_len,
    score_scale,  # scale * log2(e), or scale / softcap with SOFTCAP
    softcap_log2,  # softcap * log2(e) (SOFTCAP only)
    window,  # sliding window (a huge value for none)
    shared_prefix_len,  # every row's prefix length when not RAGGED (kv_len - n_q)
    GROUP: tl.constexpr, M_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, RAGGED: tl.constexpr,
):
    """One program per (request, KV head, split): online softmax over its keys for all M rows."""
    pid = tl.program_id(0)  # request * kv_heads + kv_head
    split = tl.program_id(1)
    b = pid // kv_heads
    h = pid % kv_heads

    rows = tl.arange(0, M_PAD)  # [M_PAD]
    node = rows % n_q  # [M_PAD]
    row_ok = rows < GROUP * n_q  # [M_PAD]
    dims = tl.arange(0, D_PAD)  # [D_PAD]
    dim_ok = dims < head_dim  # [D_PAD]
    q_head = h * GROUP + rows // n_q  # [M_PAD]
    q_offs = b.to(tl.int64) * stride_qb + q_head.to(tl.int64) * stride_qh + node.to(tl.int64) * stride_qn  # [M_PAD]
    q = tl.load(q_ptr + q_offs[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)  # [M_PAD, D_PAD]

    if RAGGED:
        prefix_len = tl.load(prefix_len_ptr + b).to(tl.int32)
    else:
        prefix_len = shared_prefix_len
    tree = b * tree_stride
    ancestors = tl.load(ancestors_ptr + tree + node, mask=row_ok, other=0)  # [M_PAD] int64
    query_pos = prefix_len + tl.load(depth_ptr + tree + node, mask=row_ok, other=0)  # [M_PAD]

    # Keys this split reads: [start, end) within [first key of the root's window, end of the block).
    lo = tl.maximum(prefix_len + 1 - window, 0)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, prefix_len + n_q)

    k_head = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_head = v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    running_max = tl.full([M_PAD], float("-inf"), tl.float32)  # [M_PAD] (base 2)
    running_sum = tl.zeros([M_PAD], tl.float32)  # [M_PAD]
    acc = tl.zeros([M_PAD, D_PAD], tl.float32)  # [M_PAD, D_PAD]
    for tile in range(start, end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_ok = keys < end  # [BLOCK_N]
        kv_mask = key_ok[:, None] & dim_ok[None, :]  # [BLOCK_N, D_PAD]
        k = tl.load(k_head + keys.to(tl.int64)[:, None] * stride_kn + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_head + keys.to(tl.int64)[:, None] * stride_vn + dims[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)  # [BLOCK_N, D_PAD]
            v = v.to(tl.float32)  # [BLOCK_N, D_PAD]
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [M_PAD, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(k))  # [M_PAD, BLOCK_N], float32 accumulation
        if SOFTCAP:
            # softcap * tanh(scale * s / softcap), tanh written with exp2 (the interpreter has no tanh)
            e = tl.exp2(2.8853900817779268 * (s * score_scale))  # exp(2x) = exp2(2 log2(e) x)
            s = softcap_log2 * (1.0 - 2.0 / (e + 1.0))
        else:
            s = s * score_scale

        # The mask, from the tables: prefix keys, ancestors-or-self in the block, the window.
        block_index = keys - prefix_len  # [BLOCK_N]
        in_prefix = block_index < 0  # [BLOCK_N]
        in_block = (block_index >= 0) & (block_index < n_q)  # [BLOCK_N]
        bit = tl.where(in_block, block_index, 0).to(tl.int64)  # [BLOCK_N]
        key_depth = tl.load(depth_ptr + tree + bit, mask=in_block, other=0)  # [BLOCK_N]
        key_pos = tl.where(in_prefix, keys, prefix_len + key_depth)  # [BLOCK_N]
        is_ancestor = ((ancestors[:, None] >> bit[None, :]) & 1) != 0  # [M_PAD, BLOCK_N]
        visible = (in_prefix[None, :] | (in_block[None, :] & is_ancestor)) & key_ok[None, :]  # [M_PAD, BLOCK_N]
        visible = visible & (key_pos[None, :] > query_pos[:, None] - window)  # [M_PAD, BLOCK_N]
        s = tl.where(visible, s, float("-inf"))  # [M_PAD, BLOCK_N]

        new_max = tl.maximum(running_max, tl.max(s, axis=1))  # [M_PAD]
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # [M_PAD] (no key seen yet: no shift)
        correction = tl.exp2(running_max - safe_max)  # [M_PAD]
        p = tl.exp2(s - safe_max[:, None])  # [M_PAD, BLOCK_N]
        running_sum = running_sum * correction + tl.sum(p, axis=1)
        if DOT_FP32:
            pv = tl.dot(p, v, input_precision="ieee")  # [M_PAD, D_PAD]
        else:
            pv = tl.dot(p.to(v.dtype), v)  # [M_PAD, D_PAD]
        acc = acc * correction[:, None] + pv
        running_max = new_max

    if SPLIT:
        part = (pid * num_splits + split).to(tl.int64) * M_PAD + rows  # [M_PAD]
        tl.store(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(part_max_ptr + part, running_max, mask=row_ok)
        tl.store(part_sum_ptr + part, running_sum, mask=row_ok)
    else:
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]  # [M_PAD, D_PAD]
        o_offs = b.to(tl.int64) * stride_ob + q_head.to(tl.int64) * stride_oh + node.to(tl.int64) * stride_on
        tl.store(out_ptr + o_offs[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [batch, q_heads, n_q, head_dim] (strided)
    part_acc_ptr,  # [batch * kv_heads, splits, M_PAD, D_PAD] float32
    part_max_ptr,  # [batch * kv_heads, splits, M_PAD] float32
    part_sum_ptr,  # [batch * kv_heads, splits, M_PAD] float32
    stride_ob, stride_oh, stride_on,
    kv_heads, n_q, head_dim, num_splits,
    GROUP: tl.constexpr, M_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    """One program per (request, KV head): merges the splits' partial softmaxes and normalises."""
    pid = tl.program_id(0)
    b = pid // kv_heads
    h = pid % kv_heads
    rows = tl.arange(0, M_PAD)  # [M_PAD]
    dims = tl.arange(0, D_PAD)  # [D_PAD]
    row_ok = rows < GROUP * n_q  # [M_PAD]: only these rows were written
    mask = row_ok[:, None] & (dims < head_dim)[None, :]  # [M_PAD, D_PAD]
    running_max = tl.full([M_PAD], float("-inf"), tl.float32)  # [M_PAD]
    running_sum = tl.zeros([M_PAD], tl.float32)  # [M_PAD]
    acc = tl.zeros([M_PAD, D_PAD], tl.float32)  # [M_PAD, D_PAD]
    for split in range(num_splits):
        part = (pid * num_splits + split).to(tl.int64) * M_PAD + rows  # [M_PAD]
        split_max = tl.load(part_max_ptr + part, mask=row_ok, other=float("-inf"))  # [M_PAD]
        new_max = tl.maximum(running_max, split_max)  # [M_PAD]
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # [M_PAD]
        old_weight = tl.exp2(running_max - safe_max)  # [M_PAD]
        split_weight = tl.exp2(split_max - safe_max)  # [M_PAD]
        split_sum = tl.load(part_sum_ptr + part, mask=row_ok, other=0.0)  # [M_PAD]
        split_acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], mask=mask, other=0.0)
        # split_acc: [M_PAD, D_PAD]
        running_sum = running_sum * old_weight + split_sum * split_weight
        acc = acc * old_weight[:, None] + split_acc * split_weight[:, None]
        running_max = new_max
    out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]  # [M_PAD, D_PAD]
    node = rows % n_q  # [M_PAD]
    q_head = h * GROUP + rows // n_q  # [M_PAD]
    o_offs = b.to(tl.int64) * stride_ob + q_head.to(tl.int64) * stride_oh + node.to(tl.int64) * stride_on  # [M_PAD]
    tl.store(out_ptr + o_offs[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def tree_tables(parents: torch.Tensor | list | tuple | None, n_q: int, device: torch.device | str):
    """``(ancestors [rows, n_q] int64, depth [rows, n_q] int32)`` on ``device``: the kernel's mask tables.

    Built on the CPU with Python integers (n_q <= 64 nodes; bit 63 needs two's complement) and
    copied once; a caller that runs many layers over one tree builds them once
    (``kernels.hf_attention`` caches them per forward).
    """
    if n_q > MAX_QUERIES:
        raise ValueError(f"tree attention takes at most {MAX_QUERIES} block tokens, got {n_q}")
    tree = parents_table(parents.cpu() if isinstance(parents, torch.Tensor) else parents, n_q, "cpu").tolist()
    ancestors, depths = [], []
    for row in tree:
        bits: list[int] = []
        depth: list[int] = []
        for i, parent in enumerate(row):
            bits.append((bits[parent] if parent >= 0 else 0) | (1 << i))
            depth.append(depth[parent] + 1 if parent >= 0 else 0)
        ancestors.append([bit - (1 << 64) if bit >= 1 << 63 else bit for bit in bits])
        depths.append(depth)
    return (torch.tensor(ancestors, dtype=torch.int64).to(device, non_blocking=True),  # [rows, n_q]
            torch.tensor(depths, dtype=torch.int32).to(device, non_blocking=True))  # [rows, n_q]


def fits(group: int, n_q: int, head_dim: int) -> bool:
    """Whether the kernel takes a forward of ``n_q`` tokens with GQA group ``group`` and this head_dim."""
    m_pad = max(16, triton.next_power_of_2(group * n_q))
    return n_q <= MAX_QUERIES and m_pad * max(16, triton.next_power_of_2(head_dim)) <= MAX_TILE


def _launch_config(m_pad: int, d_pad: int) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` for a query tile of ``m_pad x d_pad``.

    Chosen so that sm_90 compiles every tile without register spills (checked with ptxas at 8 warps,
    up to 255 registers per thread): fewer keys per tile as the query tile grows. Not tuned on a
    GPU yet; ``benchmarks/kernels.py`` is where to measure alternatives.
    """
    if d_pad <= 128:
        block_n = 64 if m_pad <= 32 else 32 if m_pad <= 64 else 16
    else:
        block_n = 32 if m_pad <= 16 else 16
    return block_n, 8, 3 if d_pad <= 128 else 2


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter


def tree_attention(
    q: torch.Tensor,  # [batch, q_heads, n_q, head_dim]: the block's queries, node order
    k: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]: prefix, then the block's own keys
    v: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    parents: torch.Tensor | list | tuple | None = None,  # [n_q] or [batch, n_q] int; None = chain
    prefix_lens: torch.Tensor | None = None,  # [batch] int in [0, kv_len - n_q] (unchecked: a check syncs)
    *,
    scale: float | None = None,  # None = head_dim ** -0.5
    sliding_window: int | None = None,  # None or 0 = full attention
    softcap: float | None = None,  # None or 0 = no soft cap
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,  # tree_tables(parents, ...), prebuilt
    num_splits: int | None = None,  # None = chosen from the GPU's size (tests force a value)
) -> torch.Tensor:  # [batch, q_heads, n_q, head_dim], q's dtype, memory laid out [batch, n_q, q_heads, head_dim]
    """Triton twin of ``kernels.reference.tree_attention.tree_attention`` (same arguments, same result)."""
    batch, q_heads, n_q, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k and v must be [batch, kv_heads, kv_len, {head_dim}], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if not fits(q_heads // kv_heads, n_q, head_dim):
        raise ValueError(f"tree attention takes at most {MAX_QUERIES} block tokens and a query tile of "
                         f"{MAX_TILE} elements (group x n_q x head_dim, padded), got n_q={n_q}, group "
                         f"{q_heads // kv_heads}, head_dim {head_dim}")
    if n_q > kv_len:
        raise ValueError(f"the cache ({kv_len} positions) must hold the block's own {n_q} keys")
    if k.dtype != q.dtype or v.dtype != q.dtype or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q, k and v must share one of float32 / float16 / bfloat16, "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    group = q_heads // kv_heads
    device = q.device
    # Memory [batch, n_q, q_heads, head_dim]: what transformers wants back (see the module doc).
    out = torch.empty(batch, n_q, q_heads, head_dim, dtype=q.dtype, device=device).transpose(1, 2)
    if batch == 0 or n_q == 0:
        return out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    ancestors, depth = tables if tables is not None else tree_tables(parents, n_q, device)  # [rows, n_q] x2
    if ancestors.shape[0] not in (1, batch):
        raise ValueError(f"parents must be [n_q] or [batch, n_q], got {ancestors.shape[0]} trees for batch {batch}")
    # One prefix length for all rows (the HF case) needs no tensor, so no extra launch per call.
    prefix = ancestors if prefix_lens is None else prefix_lens.to(device=device, dtype=torch.long).contiguous()
    scale = head_dim**-0.5 if scale is None else float(scale)
    window = int(sliding_window) if sliding_window else _NO_WINDOW

    m_pad = max(16, triton.next_power_of_2(group * n_q))
    d_pad = max(16, triton.next_power_of_2(head_dim))
    # Keys any row reads (a bound, so no device sync): the whole cache, or the root's window + block.
    max_keys = min(kv_len, window + n_q - 1)
    if num_splits is None:
        # Split only to fill the GPU (~2 programs per SM): a split's partial result costs traffic.
        pairs, sms = batch * kv_heads, _num_sms(device)
        wanted = 1 if pairs >= sms else triton.cdiv(2 * sms, pairs)
        num_splits = max(1, min(wanted, triton.cdiv(max_keys, MIN_KEYS_PER_SPLIT)))
    block_n, num_warps, num_stages = _launch_config(m_pad, d_pad)
    split_len = triton.cdiv(triton.cdiv(max_keys, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_keys, split_len)
    split = num_splits > 1
    if split:
        part_acc = torch.empty(batch * kv_heads, num_splits, m_pad, d_pad, dtype=torch.float32, device=device)
        part_max = torch.empty(batch * kv_heads, num_splits, m_pad, dtype=torch.float32, device=device)
        part_sum = torch.empty(batch * kv_heads, num_splits, m_pad, dtype=torch.float32, device=device)
    else:
        part_acc = part_max = part_sum = out  # unused
    softcap = float(softcap) if softcap else 0.0
    _tree_attention_kernel[(batch * kv_heads, num_splits)](
        q, k, v, out, prefix, ancestors, depth, part_acc, part_max, part_sum,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        0 if ancestors.shape[0] == 1 else n_q,
        kv_heads, n_q, head_dim, num_splits, split_len,
        scale / softcap if softcap else scale * _LOG2E,
        softcap * _LOG2E,
        window,
        kv_len - n_q,
        GROUP=group, M_PAD=m_pad, D_PAD=d_pad, BLOCK_N=block_n, SPLIT=split, SOFTCAP=bool(softcap),
        DOT_FP32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _interpreted()),
        RAGGED=prefix_lens is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _merge_splits_kernel[(batch * kv_heads,)](
            out, part_acc, part_max, part_sum, out.stride(0), out.stride(1), out.stride(2),
            kv_heads, n_q, head_dim, num_splits, GROUP=group, M_PAD=m_pad, D_PAD=d_pad, num_warps=num_warps,
        )
    return out
