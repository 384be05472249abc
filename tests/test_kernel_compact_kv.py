"""KV compaction (``kernels.compact_kv``) against its reference, interpreted on CPU, compiled on CUDA.

Pure data movement, so the check is bit-exact equality of every cache tensor, including the
overlapping moves (a destination that is another row's source), ragged paths in one batch, an
empty path, the identity path (a chain verdict) and a transformers ``DynamicCache``'s own tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_kernel_verify import CUDA, DEVICE, ROOT, _interpreter_while_running  # noqa: F401  (autouse fixture)
from transformers import DynamicCache

import kernels.compact_kv as kernel_compact
from kernels.reference.compact_kv import compact_kv


def _check(caches: list[torch.Tensor], base_len, accepted_nodes, num_accepted) -> None:
    expected = [cache.clone() for cache in caches]
    compact_kv(expected, base_len, accepted_nodes, num_accepted)
    on_device = [cache.to(DEVICE) for cache in caches]
    kernel_compact.compact_kv(on_device, base_len.to(DEVICE), accepted_nodes.to(DEVICE), num_accepted.to(DEVICE))
    for got, want in zip(on_device, expected):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_paths_move_into_place(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(4, 2, 24, 16, generator=g).to(dtype) for _ in range(6)]  # 3 layers x (K, V)
    accepted = torch.tensor([
        [2, 3, -1, -1, -1, -1],  # overlapping: node 3 moves into node 2's slot after node 2 moved out
        [1, 4, 6, -1, -1, -1],  # ragged, with a row already in place
        [1, 2, 3, 4, -1, -1],  # a chain verdict: nothing moves
        [-1, -1, -1, -1, -1, -1],  # nothing accepted
    ])  # [batch, n]
    _check(caches, torch.tensor([3, 10, 0, 7]), accepted, torch.tensor([2, 3, 4, 0]))


def test_odd_head_dim_and_a_dynamic_cache() -> None:
    """head_dim 12 (not a power of two), and the K/V tensors of a transformers DynamicCache."""
    g = torch.Generator().manual_seed(1)
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.randn(1, 2, 15, 12, generator=g), torch.randn(1, 2, 15, 12, generator=g), layer)
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]  # 2 layers x (K, V)
    _check(tensors, torch.tensor([9]), torch.tensor([[2, 5, 6, -1, -1, -1]]), torch.tensor([3]))


_AOT_SCRIPT = """
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.compact_kv as kc

signature = {"table_ptr": "*i64", "base_len_ptr": "*i64", "accepted_ptr": "*i64", "num_accepted_ptr": "*i64",
             "n": "i32", "stride_b": "i32", "stride_h": "i32", "stride_s": "i32", "head_dim": "i32",
             "ELEMENT": "constexpr", "N_PAD": "constexpr", "D_PAD": "constexpr"}
source = ASTSource(kc._compact_kv_kernel, signature, constexprs={"ELEMENT": tl.bfloat16, "N_PAD": 8, "D_PAD": 128})
assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
print("compiled")
"""


def test_compact_kv_compiles_for_hopper_without_a_gpu(tmp_path) -> None:
    """As in test_kernel_verify.py: the compiler, not the interpreter, must accept the kernel."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_llama3_layers_in_one_launch() -> None:
    """32 layers x (K, V), 8 KV heads of 128, bf16, 8k context: the shape the target holds."""
    g = torch.Generator(device="cuda").manual_seed(2)
    caches = [torch.randn(1, 8, 8192, 128, device="cuda", generator=g).bfloat16() for _ in range(64)]
    expected = [cache.clone() for cache in caches]
    base = torch.tensor([8000], device="cuda")  # [1]
    accepted = torch.tensor([[1, 3, 6, 8, -1, -1, -1, -1]], device="cuda")  # [1, n]
    num = torch.tensor([4], device="cuda")  # [1]
    compact_kv(expected, base, accepted, num)
    kernel_compact.compact_kv(caches, base, accepted, num)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))
