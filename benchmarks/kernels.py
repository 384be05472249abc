"""Microbenchmark of the Triton verification kernels against their PyTorch references (GPU only).

For Llama-3-8B shapes (vocabulary 128256, bf16 logits) at batch 1, 8 and 32 and k = 1, 4 and 8, and
for the plain sampling step (k = 0), it reports per op and mode:

- microseconds per call of the Triton kernel and of the reference (``triton.testing.do_bench``,
  median, L2 flushed between calls, so every call reads its inputs from HBM);
- the achieved fraction of HBM bandwidth for the bytes the op must read: the logits once, plus the
  exponentials (one fp32 row per request) and q for sampled modes; H200 peak 4.8 TB/s
  (``--peak-tbps`` for another GPU);
- the speedup over the reference on the same GPU, and whether both returned the same tokens.

Ops: ``verify_chain`` (k = 1, 4, 8), ``sample_tokens`` (k = 0) and ``verify_tree`` (random trees
of 4 and 8 nodes, in the k column; its reference walks each tree in Python, so its speedup says
more about the reference than about the kernel), ``compact_kv`` (Llama-3-8B's 32 layers x (K, V),
8 KV heads of 128, 1k positions per request; k = accepted path length, every other node of a tree
of 2k; bytes = the path's rows, read once; the writes are as many again).

``tree_attention`` (the attention of a verify pass, ``kernels.tree_attention``): Llama-3-8B's
32 query heads over 8 KV heads of 128, bf16, a random tree of k draft nodes plus the root (k = 0:
a single-token decode step with the same kernel) over a context of 1k and 8k positions; bytes =
the K and V the step must read (``2 * batch * 8 * context * 128 * 2``); its rows add the context,
``vs_decode`` (the step's time over the same kernel's single-token decode at that batch and
context; goal at k = 8: <= 1.3) and ``vs_sdpa_decode`` (over PyTorch SDPA's single-token decode,
``enable_gqa``, at that batch and context). Its reference materialises float32 copies of the
cache, so its speedup mostly says how much memory the reference wastes.

Modes: ``greedy`` (temperature 0, one-hot q: prompt lookup or a greedy draft), ``sampled`` (T = 1,
a draft sampling from its top-8, so q has m = 8 ids per position) and ``sampled-topp-topk``
(``sampled`` with top_p = 0.9 and top_k = 50: the bisection passes of the kernel).

    python benchmarks/kernels.py [--json PATH] [--peak-tbps 4.8] [--ops verify,tree_attention,...]

``--ops`` picks op groups (``verify``: verify_chain and sample_tokens; ``tree``; ``compact_kv``;
``tree_attention``); the JSON is rewritten after each group, so a run cut short keeps its rows.

Exits with status 2 and a message on a machine without CUDA. Speed is measured here, never
asserted by a unit test (DESIGN §6).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `kernels`

VOCAB = 128_256  # Llama-3
BATCHES = (1, 8, 32)
DRAFT_LENGTHS = (1, 4, 8)
TREE_SIZES = (4, 8)  # draft nodes per tree (random trees: node i's parent uniform in 0..i-1)
KV_LAYERS, KV_HEADS, HEAD_DIM, KV_CONTEXT = 32, 8, 128, 1024  # Llama-3-8B's cache, 1k positions
Q_HEADS = 32  # Llama-3-8B's query heads (GQA group 4 over KV_HEADS)
ATTENTION_CONTEXTS = (1024, 8192)  # positions in the cache (prefix + block) for tree_attention
OP_GROUPS = ("verify", "tree", "compact_kv", "tree_attention")
DRAFT_TOP_M = 8  # ids per position of a sampling draft's sparse q
MODES = {  # name: (temperature, top_p, top_k, m)
    "greedy": (0.0, 0.0, 0, 1),
    "sampled": (1.0, 0.0, 0, DRAFT_TOP_M),
    "sampled-topp-topk": (1.0, 0.9, 50, DRAFT_TOP_M),
}


@dataclass
class Row:
    op: str  # verify_chain or sample_tokens
    mode: str
    batch: int
    k: int
    triton_us: float
    reference_us: float
    speedup: float
    bytes_read: int
    achieved_tbps: float
    hbm_fraction: float
    matches_reference: bool
    context: int = 0  # tree_attention only: cache positions read
    vs_decode: float = 0.0  # tree_attention only: triton_us / the same kernel's single-token decode
    vs_sdpa_decode: float = 0.0  # tree_attention only: triton_us / PyTorch SDPA's single-token decode


def _inputs(batch: int, k: int, mode: str, generator: torch.Generator):
    """verify_chain's arguments on the GPU for one configuration."""
    from kernels.reference import draw_exponentials, draw_uniforms

    temperature, top_p, top_k, m = MODES[mode]
    dev = "cuda"
    logits = (3.0 * torch.randn(batch, k + 1, VOCAB, device=dev, generator=generator)).bfloat16()  # [batch, k+1, V]
    q_ids = torch.randint(0, VOCAB, (batch, k, m), device=dev, generator=generator)  # [batch, k, m]
    draft = q_ids[..., 0].contiguous()  # [batch, k]: the draft token is in q's support
    q_probs = torch.softmax(torch.randn(batch, k, m, device=dev, generator=generator), -1)  # [batch, k, m]
    return (
        logits,
        draft,
        q_ids,
        q_probs,
        torch.full((batch,), temperature, device=dev),  # [batch]
        torch.full((batch,), top_p, device=dev),  # [batch]
        torch.full((batch,), top_k, dtype=torch.long, device=dev),  # [batch]
        draw_uniforms((batch, k), generator),  # [batch, k]
        draw_exponentials((batch, VOCAB), generator),  # [batch, V]
    )


def _tree_inputs(batch: int, n: int, mode: str, generator: torch.Generator):
    """verify_tree's arguments on the GPU: a chain's inputs for n nodes, plus random parents."""
    logits, draft, q_ids, q_probs, *rest = _inputs(batch, n, mode, generator)
    parents = torch.stack(
        [torch.randint(0, i + 1, (batch,), device="cuda", generator=generator) for i in range(n)], 1
    )  # [batch, n]
    return (logits, draft, parents, q_ids, q_probs, *rest)


def _bytes_read(args, mode: str) -> int:
    """What the op cannot avoid reading from HBM: all logits; the race and q when sampling."""
    logits, draft, q_ids, q_probs, *_, uniforms, exponentials = args
    total = logits.numel() * logits.element_size() + draft.numel() * draft.element_size()
    if mode != "greedy":
        total += sum(t.numel() * t.element_size() for t in (q_ids, q_probs, uniforms, exponentials))
    return total


def _time_us(fn) -> float:
    from triton.testing import do_bench

    return 1000.0 * do_bench(fn, warmup=25, rep=100, return_mode="median")


def run(peak_tbps: float, ops=OP_GROUPS, on_rows=lambda rows: None) -> list[Row]:
    """Every row of the op groups in ``ops``; ``on_rows(rows so far)`` after each group."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows: list[Row] = []
    if "verify" in ops or "tree" in ops:
        rows += _verification_rows(peak_tbps, generator, ops)
        on_rows(rows)
    if "compact_kv" in ops:
        rows += _compact_kv_rows(peak_tbps, generator)
        on_rows(rows)
    if "tree_attention" in ops:
        rows += _tree_attention_rows(peak_tbps, generator)
        on_rows(rows)
    return rows


def _verification_rows(peak_tbps: float, generator: torch.Generator, ops) -> list[Row]:
    import kernels.reference.tree as reference_tree
    import kernels.sampling as kernel_sampling
    import kernels.tree as kernel_tree
    import kernels.verify as kernel_verify
    from kernels import reference

    rows: list[Row] = []
    for mode in MODES:
        for batch in BATCHES:
            for k in (0, *DRAFT_LENGTHS) if "verify" in ops else ():
                args = _inputs(batch, k, mode, generator)
                if k == 0:  # the autoregressive step: sample_tokens on the single row
                    logits, *_, temperature, top_p, top_k, _, exponentials = args
                    sample_args = (logits[:, 0].contiguous(), temperature, top_p, top_k, exponentials)
                    op = "sample_tokens"
                    got = kernel_sampling.sample_tokens(*sample_args)
                    want = reference.sample_tokens(*sample_args)
                    kernel_us = _time_us(partial(kernel_sampling.sample_tokens, *sample_args))
                    reference_us = _time_us(partial(reference.sample_tokens, *sample_args))
                    matches = torch.equal(got, want)
                else:
                    op = "verify_chain"
                    got = kernel_verify.verify_chain(*args)
                    want = reference.verify_chain(*args)
                    kernel_us = _time_us(partial(kernel_verify.verify_chain, *args))
                    reference_us = _time_us(partial(reference.verify_chain, *args))
                    matches = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                nbytes = _bytes_read(args, mode)
                rows.append(_row(op, mode, batch, k, kernel_us, reference_us, nbytes, matches, peak_tbps))
            for n in TREE_SIZES if "tree" in ops else ():
                args = _tree_inputs(batch, n, mode, generator)
                got, want = kernel_tree.verify_tree(*args), reference_tree.verify_tree(*args)
                matches = all(torch.equal(a, b) for a, b in zip(got, want))
                kernel_us = _time_us(partial(kernel_tree.verify_tree, *args))
                reference_us = _time_us(partial(reference_tree.verify_tree, *args))
                chain_args = (args[0], args[1], *args[3:])  # the same tensors without the parents
                rows.append(_row("verify_tree", mode, batch, n, kernel_us, reference_us, _bytes_read(chain_args, mode),
                                 matches, peak_tbps))
    return rows


def _compact_kv_rows(peak_tbps: float, generator: torch.Generator) -> list[Row]:
    import kernels.compact_kv as kernel_compact
    import kernels.reference.compact_kv as reference_compact

    rows = []
    for batch in BATCHES:
        caches = [torch.randn(batch, KV_HEADS, KV_CONTEXT, HEAD_DIM, device="cuda", generator=generator).bfloat16()
                  for _ in range(2 * KV_LAYERS)]  # each [batch, heads, context, head_dim]
        for k in DRAFT_LENGTHS:
            base = torch.full((batch,), KV_CONTEXT - 2 * k, dtype=torch.long, device="cuda")  # [batch]
            # [batch, k]: nodes 2, 4, .., each moving into place
            accepted = (2 * torch.arange(k, device="cuda") + 2).expand(batch, k).contiguous()
            num = torch.full((batch,), k, dtype=torch.long, device="cuda")  # [batch]
            expected = [cache.clone() for cache in caches]
            reference_compact.compact_kv(expected, base, accepted, num)
            kernel_compact.compact_kv(caches, base, accepted, num)
            matches = all(torch.equal(a, b) for a, b in zip(caches, expected))
            del expected
            kernel_us = _time_us(partial(kernel_compact.compact_kv, caches, base, accepted, num))
            reference_us = _time_us(partial(reference_compact.compact_kv, caches, base, accepted, num))
            nbytes = 2 * KV_LAYERS * batch * KV_HEADS * k * HEAD_DIM * 2
            rows.append(_row("compact_kv", "bf16", batch, k, kernel_us, reference_us, nbytes, matches, peak_tbps))
        del caches
    return rows


def _tree_attention_rows(peak_tbps: float, generator: torch.Generator, device: str = "cuda") -> list[Row]:
    """Tree attention at Llama-3-8B shapes, every context and batch (see the module doc)."""
    rows = []
    for context in ATTENTION_CONTEXTS:
        for batch in BATCHES:
            rows += _tree_attention_case(peak_tbps, generator, context, batch, device)
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _tree_attention_case(
    peak_tbps: float, generator: torch.Generator, context: int, batch: int, device: str = "cuda"
) -> list[Row]:
    """One cache of ``context`` positions for ``batch`` requests; k = 0 first: the decode baseline."""
    import kernels.reference.tree_attention as reference_attention
    import kernels.tree_attention as kernel_attention

    def cache() -> torch.Tensor:  # [batch, kv_heads, context, head_dim]
        return torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device, generator=generator).bfloat16()

    def queries(n_q: int) -> torch.Tensor:  # [batch, q_heads, n_q, head_dim]
        return torch.randn(batch, Q_HEADS, n_q, HEAD_DIM, device=device, generator=generator).bfloat16()

    k_cache, v_cache = cache(), cache()
    nbytes = 2 * k_cache.numel() * k_cache.element_size()  # K and V, each read once
    sdpa_decode = partial(torch.nn.functional.scaled_dot_product_attention, queries(1), k_cache, v_cache,
                          enable_gqa=True)
    sdpa_us = _time_us(sdpa_decode)
    rows, decode_us = [], 0.0
    for k in (0, *DRAFT_LENGTHS):
        q = queries(k + 1)
        parents = [-1] + [int(torch.randint(0, i, (1,), device=device, generator=generator)) for i in range(1, k + 1)]
        tables = kernel_attention.tree_tables(parents, k + 1, device)  # once per forward, as in the glue
        kernel = partial(kernel_attention.tree_attention, q, k_cache, v_cache, parents, tables=tables)
        reference = partial(reference_attention.tree_attention, q, k_cache, v_cache, parents)
        matches = (kernel().float() - reference().float()).abs().max().item() <= 2e-2
        kernel_us, reference_us = _time_us(kernel), _time_us(reference)
        decode_us = decode_us or kernel_us  # k = 0 comes first
        rows.append(_row("tree_attention", "bf16", batch, k, kernel_us, reference_us, nbytes, matches, peak_tbps,
                         context=context, vs_decode=round(kernel_us / decode_us, 3),
                         vs_sdpa_decode=round(kernel_us / sdpa_us, 3)))
    return rows


def _row(op, mode, batch, k, kernel_us, reference_us, nbytes, matches, peak_tbps, **extra) -> Row:
    tbps = nbytes / (kernel_us * 1e-6) / 1e12
    row = Row(op, mode, batch, k, round(kernel_us, 2), round(reference_us, 2), round(reference_us / kernel_us, 2),
              nbytes, round(tbps, 3), round(tbps / peak_tbps, 3), matches, **extra)
    print(_format(row), flush=True)
    return row


HEADER = (f"{'op':<16}{'mode':<19}{'batch':>6}{'k':>4}{'triton us':>11}{'ref us':>11}{'speedup':>9}"
          f"{'MB read':>9}{'TB/s':>7}{'HBM %':>7}  match")


def _format(row: Row) -> str:
    return (f"{row.op:<16}{row.mode:<19}{row.batch:>6}{row.k:>4}{row.triton_us:>11.1f}{row.reference_us:>11.1f}"
            f"{row.speedup:>8.1f}x{row.bytes_read / 1e6:>9.2f}{row.achieved_tbps:>7.2f}{100 * row.hbm_fraction:>6.1f}%"
            f"  {'yes' if row.matches_reference else 'NO'}"
            + (f"  context {row.context:>5}  vs decode {row.vs_decode:.2f}x  vs SDPA decode {row.vs_sdpa_decode:.2f}x"
               if row.context else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=Path("kernels_benchmark.json"), help="where to write the rows")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="the GPU's HBM bandwidth (H200: 4.8 TB/s)")
    parser.add_argument("--ops", default=",".join(OP_GROUPS),
                        help=f"comma-separated op groups to measure, among {', '.join(OP_GROUPS)} (default: all)")
    options = parser.parse_args()
    ops = tuple(op.strip() for op in options.ops.split(",") if op.strip())
    unknown = sorted(set(ops) - set(OP_GROUPS))
    if unknown:
        parser.error(f"unknown op group(s) {', '.join(unknown)}; choose among {', '.join(OP_GROUPS)}")
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py measures the Triton kernels on a CUDA GPU, and this machine has none "
              "(torch.cuda.is_available() is False); nothing was measured.", file=sys.stderr)
        return 2
    import triton

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"vocab {VOCAB}, bf16 logits, peak {options.peak_tbps} TB/s")
    print(HEADER, flush=True)

    def write(rows: list[Row]) -> None:
        report = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "vocab": VOCAB,
            "peak_tbps": options.peak_tbps,
            "rows": [asdict(row) for row in rows],
        }
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(report, indent=2))

    rows = run(options.peak_tbps, ops, on_rows=write)
    differing = sum(not row.matches_reference for row in rows)
    print(f"\nwrote {options.json}; {differing} configuration(s) differ from the reference")
    return 0

if __name__ == "__main__":
    sys.exit(main())
