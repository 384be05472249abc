"""The Triton tree attention (``kernels.tree_attention``) against its PyTorch reference.

Interpreted on CPU (``TRITON_INTERPRET=1``, sizes tiny), compiled where CUDA is present, plus the
``gpu``-marked cases (bf16 at Llama-3-8B head shapes, long contexts, many splits).

Tolerances: both sides compute in float32 but sum in different orders (online softmax over tiles
and splits against one softmax), so float32 inputs agree to 2e-5 absolute on outputs of order 1.
Half inputs: the reference rounds only its output to the input dtype, while on a GPU the kernel
also multiplies P (rounded to the input dtype) by V on the tensor cores: fp16 within 2e-3, bf16
within 2e-2 (a few units in the last place of outputs of order 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.reference.tree_attention import tree_attention

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _import_kernel():
    """Imports the kernel module, interpreted on CPU: Triton reads the variable when a kernel is
    decorated, so it is set around the import only (as in test_kernel_verify.py)."""
    previous = os.environ.get("TRITON_INTERPRET")
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import kernels.tree_attention as module
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module


kernel = _import_kernel()


@pytest.fixture(autouse=True)
def _interpreter_while_running(monkeypatch):
    """Triton also consults the variable lazily while launching; keep it set during each test."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


CHAIN = None  # the default tree: [-1, 0, 1, ..]


def _inputs(batch, q_heads, kv_heads, n_q, kv_len, head_dim, dtype=torch.float32, seed=0):
    """q [batch, q_heads, n_q, head_dim], k, v [batch, kv_heads, kv_len, head_dim] (CPU)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, n_q, head_dim, generator=g).to(dtype)  # [batch, q_heads, n_q, head_dim]
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g).to(dtype)  # [batch, kv_heads, kv_len, head_dim]
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g).to(dtype)  # [batch, kv_heads, kv_len, head_dim]
    return q, k, v


def _check(q, k, v, parents=None, prefix_lens=None, **options) -> None:
    want = tree_attention(q, k, v, parents, prefix_lens, **{k_: v_ for k_, v_ in options.items() if k_ != "num_splits"})
    on = [t.to(DEVICE) for t in (q, k, v)]
    got = kernel.tree_attention(*on, parents, None if prefix_lens is None else prefix_lens.to(DEVICE), **options)
    assert got.shape == want.shape and got.dtype == want.dtype
    # The output is laid out [batch, n_q, q_heads, head_dim] in memory, as transformers wants it back.
    assert got.transpose(1, 2).is_contiguous()
    error = (got.cpu().float() - want.float()).abs().max().item()
    assert error <= TOLERANCE[q.dtype], f"max |kernel - reference| = {error:.2e}"


@pytest.mark.parametrize(
    "n_q, parents",
    [
        (1, CHAIN),  # k = 0: a plain decode step (the root only)
        (2, CHAIN),  # k = 1
        (5, CHAIN),  # k = 4
        (5, [-1, 0, 1, 2, 3]),  # the same chain spelled out
        (6, [-1, 0, 1, 1, 3, 4]),  # one branch off a chain
        (7, [-1, 0, 0, 0, 0, 0, 0]),  # wide: every draft a child of the root
        (9, [-1, 0, 0, 1, 1, 2, 4, 4, 6]),  # a random-looking tree
        (4, [-1, 0, -1, 2]),  # two roots (a forest): each sees the prefix, its ancestors and itself
    ],
)
def test_trees_match_reference(n_q, parents) -> None:
    """GQA group 2, head_dim 16, context 37 (not a multiple of any tile)."""
    _check(*_inputs(2, 4, 2, n_q, 37, 16, seed=n_q), parents)


@pytest.mark.parametrize("q_heads, kv_heads", [(3, 3), (8, 2), (4, 1)])
def test_gqa_groups(q_heads, kv_heads) -> None:
    """Group sizes 1, 4 and 4 with a single KV head (Gemma 3 270m: 4 query heads, 1 KV head)."""
    _check(*_inputs(1, q_heads, kv_heads, 4, 23, 16), [-1, 0, 0, 1])


def test_ragged_prefixes_per_row_trees_and_padding() -> None:
    """Rows with different prefixes in one cache (the rest of each row is padding, never read,
    here filled with NaN to prove it) and one tree per row."""
    q, k, v = _inputs(3, 4, 2, 4, 40, 16, seed=3)
    prefix_lens = torch.tensor([36, 0, 17])  # [batch]: a full row, an empty prefix, a short one
    for b, end in enumerate((prefix_lens + 4).tolist()):
        k[b, :, end:] = float("nan")
        v[b, :, end:] = float("nan")
    parents = torch.tensor([[-1, 0, 1, 2], [-1, 0, 0, 0], [-1, 0, 1, 0]])  # [batch, n_q]
    _check(q, k, v, parents, prefix_lens)


@pytest.mark.parametrize("head_dim", [24, 8, 40])
def test_head_dims_that_are_not_powers_of_two(head_dim) -> None:
    """head_dim is padded to a power of two (>= 16) inside the kernel and masked."""
    _check(*_inputs(1, 2, 1, 3, 19, head_dim, seed=head_dim), [-1, 0, 0])


@pytest.mark.parametrize(
    "window, parents",
    [
        (6, CHAIN),  # cuts through the prefix only
        (3, CHAIN),  # cuts through the block: late chain tokens lose the root
        (2, [-1, 0, 1, 1, 3]),  # a tree: positions are prefix_len + depth, not block indices
        (1, [-1, 0, 0]),  # every token sees only itself
    ],
)
def test_sliding_window(window, parents) -> None:
    n_q = 5 if parents is None else len(parents)
    q, k, v = _inputs(2, 4, 2, n_q, 30, 16, seed=window)
    _check(q, k, v, parents, torch.tensor([25, 11]), sliding_window=window)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_keys_merge_exactly(splits) -> None:
    """Flash-decoding splits (forced; a GPU picks them from its size), windowed and not."""
    q, k, v = _inputs(2, 4, 2, 3, 150, 16, seed=splits)
    _check(q, k, v, [-1, 0, 0], torch.tensor([147, 60]), num_splits=splits)
    _check(q, k, v, [-1, 0, 1], torch.tensor([147, 60]), num_splits=splits, sliding_window=70)


def test_scale_and_softcap() -> None:
    q, k, v = _inputs(1, 2, 1, 3, 20, 16, seed=11)
    _check(3.0 * q, k, v, [-1, 0, 1], scale=0.7, softcap=5.0)  # large scores: the cap bites
    _check(q, k, v, [-1, 0, 1], scale=0.1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype) -> None:
    """fp16 runs the tensor-core path (P rounded to fp16) also under the interpreter; bf16 is
    multiplied in float32 there (the interpreter cannot multiply bf16) and natively on a GPU."""
    _check(*_inputs(2, 4, 2, 5, 45, 32, dtype=dtype), [-1, 0, 1, 1, 2], num_splits=2)


def test_bad_inputs_are_refused_clearly() -> None:
    q, k, v = _inputs(1, 2, 1, 3, 10, 16)
    with pytest.raises(ValueError, match="parents"):
        kernel.tree_attention(q, k, v, [-1, 2, 0])  # a parent after its child
    with pytest.raises(ValueError, match="multiple"):
        kernel.tree_attention(q[:, :1].expand(1, 3, 3, 16), torch.cat([k, k], 1), torch.cat([v, v], 1))
    big = _inputs(1, 1, 1, 65, 70, 16)
    with pytest.raises(ValueError, match="at most 64"):
        kernel.tree_attention(*big)
    assert kernel.fits(4, 64, 128) and kernel.fits(4, 32, 256) and not kernel.fits(4, 64, 256)
    with pytest.raises(ValueError, match="query tile"):  # 64 x group 4 x head_dim 256: shared memory would overflow
        kernel.tree_attention(*_inputs(1, 4, 1, 64, 64, 256))


_AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.tree_attention as ta

target = GPUTarget("cuda", 90, 32)


def signature(dtype):
    names = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
             "prefix_len_ptr": "*i64", "ancestors_ptr": "*i64", "depth_ptr": "*i32",
             "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"}
    for name in ("stride_qb", "stride_qh", "stride_qn", "stride_kb", "stride_kh", "stride_kn", "stride_vb",
                 "stride_vh", "stride_vn", "stride_ob", "stride_oh", "stride_on", "tree_stride", "kv_heads", "n_q",
                 "head_dim", "num_splits", "split_len"):
        names[name] = "i32"
    names.update(score_scale="fp32", softcap_log2="fp32", window="i32", shared_prefix_len="i32")
    names.update({name: "constexpr" for name in ("GROUP", "M_PAD", "D_PAD", "BLOCK_N", "SPLIT", "SOFTCAP", "DOT_FP32",
                                                 "RAGGED")})
    return names


# Llama-3-8B at k = 1 and k = 8 (group 4, head_dim 128), Gemma 3 (head_dim 256), fp16 + softcap, fp32.
for dtype, m_pad, d_pad, split, softcap, ragged in [("bf16", 16, 128, True, False, False),
                                                   ("bf16", 64, 128, True, False, True),
                                                   ("bf16", 16, 256, False, False, False),
                                                   ("fp16", 32, 128, True, True, False),
                                                   ("fp32", 16, 64, False, False, True)]:
    block_n, warps, stages = ta._launch_config(m_pad, d_pad)
    constexprs = {"GROUP": 4, "M_PAD": m_pad, "D_PAD": d_pad, "BLOCK_N": block_n, "SPLIT": split,
                  "SOFTCAP": softcap, "DOT_FP32": dtype == "fp32", "RAGGED": ragged}
    source = ASTSource(ta._tree_attention_kernel, signature(dtype), constexprs=constexprs)
    assert triton.compile(source, target=target, options={"num_warps": warps, "num_stages": stages}).asm["cubin"]
merge = {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
         "stride_ob": "i32", "stride_oh": "i32", "stride_on": "i32", "kv_heads": "i32", "n_q": "i32",
         "head_dim": "i32", "num_splits": "i32", "GROUP": "constexpr", "M_PAD": "constexpr", "D_PAD": "constexpr"}
source = ASTSource(ta._merge_splits_kernel, merge, constexprs={"GROUP": 4, "M_PAD": 64, "D_PAD": 128})
assert triton.compile(source, target=target, options={"num_warps": 8}).asm["cubin"]
print("compiled")
"""


def test_tree_attention_compiles_for_hopper_without_a_gpu(tmp_path) -> None:
    """As in test_kernel_verify.py: the compiler, not the interpreter, must accept the kernels
    (tl.dot shapes, dtypes, the launch configurations the launcher picks)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "dtype, kv_len, n_q, window",
    [(torch.bfloat16, 1024, 9, None), (torch.bfloat16, 8192, 2, None), (torch.bfloat16, 8192, 9, 512),
     (torch.bfloat16, 4099, 5, None), (torch.float16, 8192, 9, None), (torch.float32, 4099, 9, 700)],
)
def test_gpu_llama3_shapes_match_reference(dtype, kv_len, n_q, window) -> None:
    """32 query heads, 8 KV heads of 128 at batch 3 (ragged and not), long contexts (the launcher's
    own splits), a random tree; compiled kernels, native bf16/fp16 tensor-core dots."""
    g = torch.Generator(device="cuda").manual_seed(kv_len + n_q)
    q = torch.randn(3, 32, n_q, 128, device="cuda", generator=g).to(dtype)  # [3, 32, n_q, 128]
    k = torch.randn(3, 8, kv_len, 128, device="cuda", generator=g).to(dtype)  # [3, 8, kv_len, 128]
    v = torch.randn(3, 8, kv_len, 128, device="cuda", generator=g).to(dtype)  # [3, 8, kv_len, 128]
    parents = [-1] + [int(torch.randint(0, i, (1,))) for i in range(1, n_q)]
    for prefix in (torch.tensor([kv_len - n_q, kv_len // 2, 7], device="cuda"), None):  # [3] ragged, or kv_len - n_q
        got = kernel.tree_attention(q, k, v, parents, prefix, sliding_window=window)
        want = tree_attention(q, k, v, parents, prefix, sliding_window=window)
        assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_gemma3_head_dim_256_with_softcap() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 4, 6, 256, device="cuda", generator=g).bfloat16()  # [2, 4, 6, 256]
    k = torch.randn(2, 1, 3000, 256, device="cuda", generator=g).bfloat16()  # [2, 1, 3000, 256]
    v = torch.randn(2, 1, 3000, 256, device="cuda", generator=g).bfloat16()  # [2, 1, 3000, 256]
    for window, softcap in [(512, None), (None, 50.0)]:
        got = kernel.tree_attention(q, k, v, [-1, 0, 0, 1, 2, 2], sliding_window=window, softcap=softcap,
                                    scale=256**-0.5)
        want = tree_attention(q, k, v, [-1, 0, 0, 1, 2, 2], sliding_window=window, softcap=softcap, scale=256**-0.5)
        assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[torch.bfloat16]
