"""The Triton tree verifier (``kernels.tree``) against its PyTorch reference (``kernels.reference.tree``).

Runs like test_kernel_verify.py (whose interpreter set-up and statistical helpers it reuses):
interpreted on CPU, compiled where CUDA is present. Exactness: the same accepted path, count and
next token as the reference given the same uniforms and exponentials, on random trees (one
branch, wide, ragged, root only) in batches that mix greedy, sampled, top-k and top-p requests.
Statistics: root with deterministic top-k children, the first committed token must follow p
(bound as in test_kernel_verify.py, where CUDA is present; under the interpreter fewer trials, each
committing exactly what the reference commits on the same draws).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_kernel_verify import (  # noqa: F401  (_interpreter_while_running: an autouse fixture)
    CUDA,
    DEVICE,
    ROOT,
    _assert_distributed_as,
    _interpreter_while_running,
    _to,
    _tv_bound,
)

import kernels.tree as kernel_tree
from kernels.reference import draw_exponentials, draw_uniforms, target_probs
from kernels.reference.tree import verify_tree


def _random_trees(batch: int, n: int, vocab: int, m: int, shape: str, g: torch.Generator):
    """Inputs of verify_tree for ``batch`` trees of ``n`` nodes; half the drafts are the parent's argmax."""
    logits = 2.0 * torch.randn(batch, n + 1, vocab, generator=g)  # [batch, n+1, vocab]
    if shape == "chain":  # one branch
        parents = torch.arange(n).expand(batch, n).clone()  # [batch, n]
    elif shape == "wide":  # every node a child of the root
        parents = torch.zeros(batch, n, dtype=torch.long)  # [batch, n]
    else:  # random: node i's parent uniform in 0..i-1
        parents = torch.stack([torch.randint(0, i + 1, (batch,), generator=g) for i in range(n)], 1)  # [batch, n]
    parent_argmax = logits.argmax(-1).gather(1, parents)  # [batch, n]
    draft = torch.where(torch.rand(batch, n, generator=g) < 0.5, parent_argmax,
                        torch.randint(0, vocab, (batch, n), generator=g))  # [batch, n]
    q_ids = torch.cat([draft[..., None], torch.randint(0, vocab, (batch, n, m - 1), generator=g)], -1)  # [batch, n, m]
    q_probs = torch.softmax(torch.randn(batch, n, m, generator=g), -1)  # [batch, n, m]
    temperature = torch.tensor([0.0, 1.0, 0.8, 1.0, 1.3, 1.0])[torch.arange(batch) % 6]  # [batch]
    top_p = torch.tensor([0.0, 0.0, 0.9, 0.0, 0.0, 0.7])[torch.arange(batch) % 6]  # [batch]
    top_k = torch.tensor([0, 0, 0, 5, 0, 8])[torch.arange(batch) % 6]  # [batch]
    return (logits, draft, parents, q_ids, q_probs, temperature, top_p, top_k,
            draw_uniforms((batch, n), g), draw_exponentials((batch, vocab), g))


def _assert_same(args, num_nodes=None) -> None:
    got = kernel_tree.verify_tree(*_to(DEVICE, *args), None if num_nodes is None else num_nodes.to(DEVICE))
    want = verify_tree(*args, num_nodes)
    for name, g, w in zip(("num_accepted", "accepted_nodes", "next_token"), got, want):
        assert g.cpu().tolist() == w.tolist(), name


@pytest.mark.parametrize("shape", ["chain", "wide", "random"])
def test_trees_match_reference(shape: str) -> None:
    g = torch.Generator().manual_seed(len(shape))
    args = _random_trees(6, 6, 37, 3, shape, g)
    _assert_same(args, torch.tensor([6, 6, 5, 6, 3, 6]))  # ragged: two smaller trees


def test_fp16_logits_root_only_and_full_acceptance() -> None:
    g = torch.Generator().manual_seed(7)
    logits, draft, parents, *rest = _random_trees(6, 4, 300, 2, "random", g)
    # Request 1: one branch whose every draft token dominates its parent's row: all accepted.
    parents[1] = torch.arange(4)
    logits[1] = -5.0
    logits[1, torch.arange(4), draft[1]] = 20.0
    args = (logits.half(), draft, parents, *rest)
    _assert_same(args, torch.tensor([4, 4, 0, 4, 0, 4]))  # requests 2 and 4: the root alone (a bonus token)
    assert verify_tree(*args, torch.tensor([4, 4, 0, 4, 0, 4]))[0][1] == 4


def test_kernel_tree_sampling_reproduces_p() -> None:
    """Root with the 2 least likely tokens as deterministic children: the first token ~ p_0."""
    g = torch.Generator().manual_seed(3)
    vocab, n = 4, 2
    trials = 100_000 if CUDA else 48
    row = torch.tensor([[1.0, 0.3, -0.4, 0.6], [0.0, 0.5, -1.0, 0.2], [0.3, -0.2, 0.4, 0.0]])  # [n+1, vocab]
    p = target_probs(row[None], torch.ones(1), torch.zeros(1), torch.zeros(1, dtype=torch.long))[0]  # [n+1, vocab]
    children = p[0].argsort()[:n]  # [n]
    draft = children.expand(trials, n)  # [trials, n]
    args = (row.expand(trials, n + 1, vocab), draft, torch.zeros(trials, n, dtype=torch.long),
            draft[..., None], torch.ones(trials, n, 1), torch.ones(trials), torch.zeros(trials),
            torch.zeros(trials, dtype=torch.long), draw_uniforms((trials, n), g), draw_exponentials((trials, vocab), g))
    num_accepted, nodes, token = [t.cpu() for t in kernel_tree.verify_tree(*_to(DEVICE, *args))]
    if not CUDA:  # a few interpreted trials: the reference's commits, trial for trial
        want = verify_tree(*args)
        assert [num_accepted.tolist(), nodes.tolist(), token.tolist()] == [w.tolist() for w in want]
        assert 0 < int((num_accepted > 0).sum()) < trials  # children accepted and rejected both
        return
    first = torch.where(num_accepted > 0, draft.gather(1, (nodes[:, :1] - 1).clamp_min(0))[:, 0], token)  # [trials]
    _assert_distributed_as(first, p[0], "first token")
    # Power: always committing the first child is far outside the bound.
    assert 0.5 * (torch.nn.functional.one_hot(children[0], vocab) - p[0]).abs().sum() > 2 * _tv_bound(p[0], trials)


_AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.tree as kt

target = GPUTarget("cuda", 90, 32)
stats = {"argmax_ptr": "*i32", "row_max_ptr": "*fp32", "denom_ptr": "*fp32",
         "keep_key_ptr": "*i64", "keep_id_ptr": "*i32"}
rows = {"logits_ptr": "*bf16", "temperature_ptr": "*fp32", "top_p_ptr": "*fp32", "top_k_ptr": "*i64", **stats,
        "n": "i32", "vocab": "i32", "greedy_temperature": "fp32", "BLOCK": "constexpr", "NUM_PIVOTS": "constexpr"}
source = ASTSource(kt._tree_rows_kernel, rows, constexprs={"BLOCK": 1024, "NUM_PIVOTS": 16})
assert triton.compile(source, target=target, options={"num_warps": 8}).asm["cubin"]
walk = {"logits_ptr": "*bf16", "draft_ptr": "*i64", "parents_ptr": "*i64", "q_ids_ptr": "*i64", "q_probs_ptr": "*fp32",
        "temperature_ptr": "*fp32", "uniforms_ptr": "*fp32", "exponentials_ptr": "*fp32", "num_nodes_ptr": "*i64",
        **stats, "num_accepted_ptr": "*i64", "accepted_nodes_ptr": "*i64", "next_token_ptr": "*i64",
        "n": "i32", "vocab": "i32", "m": "i32", "greedy_temperature": "fp32", "BLOCK": "constexpr", "T_PAD": "constexpr"}
source = ASTSource(kt._tree_walk_kernel, walk, constexprs={"BLOCK": 256, "T_PAD": 64})
assert triton.compile(source, target=target).asm["cubin"]
print("compiled")
"""


def test_tree_kernels_compile_for_hopper_without_a_gpu(tmp_path) -> None:
    """As in test_kernel_verify.py: the compiler, not the interpreter, must accept the kernels."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_llama3_vocabulary_trees_match_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    logits, *rest = _random_trees(6, 8, 128_256, 4, "random", g)
    args = _to("cuda", logits.to(dtype), *rest)
    got, want = kernel_tree.verify_tree(*args), verify_tree(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
