"""The fused Triton chain verifier and sampler against their PyTorch references (DESIGN §5).

On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors; with CUDA
the same tests run compiled on the GPU, plus the ``gpu``-marked ones (bf16, Llama-3 vocabulary).

Exactness: given the same uniforms and exponentials, the kernel must commit the same token ids and
accepted counts as the reference. Both compute in float32 but not in the same order, so a draw
could in principle differ where two compared quantities agree to within rounding; with continuous
random inputs that has probability ~1e-6 per comparison, and the seeds are fixed.

Statistical bound (the kernel's own sampler, not just agreement with the reference), where CUDA
is present: blocks of k=1 on a 5-token vocabulary with a dense q far from p; the first committed
token must follow p_0 and the bonus token p_1: chi-square goodness-of-fit p-value > 1e-3 and total
variation below 4x the mean TV of an exact sampler at that n (0.5 * sum_i sqrt(2 p_i (1 - p_i) /
(pi n))), over 200,000 blocks. Under the interpreter each block is a Python-interpreted program, so
the same blocks are fewer and each must commit exactly what the reference commits on the same
draws; the reference's own sampler is checked against p statistically (test_verify_reference.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from kernels import reference
from kernels.reference import draw_exponentials, draw_uniforms, target_probs
from target_service.verifier import select_verifier

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _import_kernels():
    """Imports the kernel modules, interpreted on CPU: Triton reads the variable when a kernel is
    decorated, so it is set around the import only and restored right after (other test modules
    see the environment they had)."""
    previous = os.environ.get("TRITON_INTERPRET")
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import kernels.compact_kv  # noqa: F401  (imported here, interpreted, for test_kernel_compact_kv.py)
        import kernels.sampling as sampling_module
        import kernels.tree  # noqa: F401  (imported here, interpreted, for test_kernel_tree.py)
        import kernels.verify as verify_module
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return verify_module, sampling_module


kernel_verify, kernel_sampling = _import_kernels()


@pytest.fixture(autouse=True)
def _interpreter_while_running(monkeypatch):
    """Triton also consults the variable lazily while launching; keep it set during each test."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _to(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def _both(*args: torch.Tensor, num_draft: torch.Tensor | None = None):
    """(kernel, reference) results of verify_chain on the same inputs, as CPU tensors."""
    got = kernel_verify.verify_chain(*_to(DEVICE, *args), None if num_draft is None else num_draft.to(DEVICE))
    want = reference.verify_chain(*args, num_draft)
    return [t.cpu() for t in got], want


# --------------------------------------------------------------------------- exact agreement


def _mixed_batch(vocab: int, dtype: torch.dtype, seed: int):
    """Nine blocks of k=3 covering every path of the kernel in one launch (see the row comments)."""
    g = torch.Generator().manual_seed(seed)
    batch, k, m = 9, 3, 3
    logits = 2.0 * torch.randn(batch, k + 1, vocab, generator=g)  # [batch, k+1, vocab]
    argmax = logits.argmax(-1)  # [batch, k+1]
    draft = torch.randint(0, vocab, (batch, k), generator=g)  # [batch, k]
    draft[0] = argmax[0, :k]  # greedy, every draft token right: full acceptance + bonus
    draft[1] = (argmax[1, :k] + 1) % vocab  # greedy, wrong at once: zero acceptance
    draft[2, 0] = argmax[2, 0]  # greedy, ragged block of 2, wrong at position 1
    draft[2, 1] = (argmax[2, 1] + 1) % vocab
    logits[3, torch.arange(k), draft[3]] += 30.0  # sampled, p(d) ~ 1: full acceptance + bonus
    draft[4] = logits[4, :k].topk(2, -1).indices[:, 1]  # sampled, the target's second choices
    temperature = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 0.7, 1.3, 1.0, 1.0])  # [batch]
    top_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.8, 0.7, 0.0])  # [batch]
    top_k = torch.tensor([0, 0, 0, 0, 0, 5, 0, 4, 2])  # [batch]
    # Row 8 drafts outside its top-2, where p(d) = 0: zero acceptance, a recovered token.
    draft[8] = logits[8, :k].argsort(-1, descending=True)[:, min(2, vocab - 1)]
    num_draft = torch.tensor([3, 3, 2, 3, 3, 3, 1, 0, 3])  # [batch]; row 7 is an empty block

    # q: one-hot on the draft token, padded to m ids with probability 0 ...
    q_ids = torch.zeros(batch, k, m, dtype=torch.long)  # [batch, k, m]
    q_ids[..., 0] = draft
    q_probs = torch.zeros(batch, k, m)  # [batch, k, m]
    q_probs[..., 0] = 1.0
    # ... except rows 5 and 6: a sparse q of 3 ids (the draft among them), unlike p.
    for b in (5, 6):
        q_ids[b, :, 1:] = torch.randint(0, vocab, (k, m - 1), generator=g)
        q_probs[b] = torch.softmax(torch.randn(k, m, generator=g), -1)
    uniforms = draw_uniforms((batch, k), g)  # [batch, k]
    exponentials = draw_exponentials((batch, vocab), g)  # [batch, vocab]
    args = (logits.to(dtype), draft, q_ids, q_probs, temperature, top_p, top_k, uniforms, exponentials)
    return args, num_draft


# Tiles small enough that a row spans several (the last one partial), so that every running
# reduction (argmax, online softmax, race, tie ranks) is exercised across tiles; 7 fits one tile.
TILES = {7: 1024, 257: 128, 1000: 256}


@pytest.mark.parametrize(
    "vocab, dtype",
    [(7, torch.float32), (257, torch.float32), (1000, torch.float32), (7, torch.float16), (257, torch.float16)],
    ids=["7-fp32", "257-fp32", "1000-fp32", "7-fp16", "257-fp16"],
)
def test_mixed_batch_matches_reference(vocab: int, dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.setattr(kernel_verify, "MAX_BLOCK", TILES[vocab])
    args, num_draft = _mixed_batch(vocab, dtype, seed=vocab)
    (got_accepted, got_token), (want_accepted, want_token) = _both(*args, num_draft=num_draft)
    assert got_accepted.tolist() == want_accepted.tolist()
    assert got_token.tolist() == want_token.tolist()
    # The rows meant to pin full / zero / partial acceptance did so.
    assert want_accepted[[0, 1, 2, 3, 7, 8]].tolist() == [3, 0, 1, 3, 0, 0]


def test_bisection_is_exact_with_two_pivots_per_pass(monkeypatch) -> None:
    """The cut-off search is exact for any pivot count: 2 per pass takes ~20 passes instead of 8."""
    monkeypatch.setattr(kernel_verify, "NUM_PIVOTS", 2)
    monkeypatch.setattr(kernel_verify, "MAX_BLOCK", 128)
    args, num_draft = _mixed_batch(257, torch.float32, seed=11)
    (got_accepted, got_token), (want_accepted, want_token) = _both(*args, num_draft=num_draft)
    assert got_accepted.tolist() == want_accepted.tolist() and got_token.tolist() == want_token.tolist()


def test_greedy_argmax_ties_across_tiles_take_the_first_index(monkeypatch) -> None:
    monkeypatch.setattr(kernel_verify, "MAX_BLOCK", 16)
    vocab = 50
    logits = torch.zeros(2, 2, vocab)  # [2, 2, vocab]
    logits[:, :, [40, 9, 25]] = 5.0  # equal maxima in tiles 2, 0 and 1: token 9 is the argmax
    draft = torch.tensor([[9], [40]])  # [2, 1]: row 0 right, row 1 wrong (a later tied token)
    args = (logits, draft, draft[..., None], torch.ones(2, 1, 1), torch.zeros(2), torch.zeros(2),
            torch.zeros(2, dtype=torch.long), torch.ones(2, 1), torch.ones(2, vocab))
    (got_accepted, got_token), (want_accepted, want_token) = _both(*args)
    assert got_accepted.tolist() == want_accepted.tolist() == [1, 0]
    assert got_token.tolist() == want_token.tolist() == [9, 9]


def test_k1_blocks_and_all_defaults() -> None:
    """k = 1, num_draft_tokens omitted, many sampled rows so both outcomes occur."""
    g = torch.Generator().manual_seed(5)
    batch, vocab = 12, 31
    logits = torch.randn(batch, 2, vocab, generator=g)  # [batch, 2, vocab]
    draft = torch.randint(0, vocab, (batch, 1), generator=g)  # [batch, 1]
    q_ids = torch.stack([draft[:, 0], (draft[:, 0] + 1) % vocab], -1)[:, None, :]  # [batch, 1, 2]
    q_probs = torch.tensor([0.6, 0.4]).expand(batch, 1, 2)  # [batch, 1, 2]
    temperature = torch.tensor([0.0, 1.0] * (batch // 2))  # [batch]
    args = (logits, draft, q_ids, q_probs, temperature, torch.zeros(batch), torch.zeros(batch, dtype=torch.long),
            draw_uniforms((batch, 1), g), draw_exponentials((batch, vocab), g))
    (got_accepted, got_token), (want_accepted, want_token) = _both(*args)
    assert got_accepted.tolist() == want_accepted.tolist() and got_token.tolist() == want_token.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_sample_tokens_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    batch, vocab = 7, 257
    logits = (3.0 * torch.randn(batch, vocab, generator=g)).to(dtype)  # [batch, vocab]
    temperature = torch.tensor([0.0, 1.0, 0.5, 1.0, 2.0, 1.0, 1.0])
    top_p = torch.tensor([0.0, 0.0, 0.9, 0.0, 0.5, 1.0, 0.0])
    top_k = torch.tensor([0, 0, 0, 10, 20, 0, 1])  # the last row: top-1 is the argmax
    exponentials = draw_exponentials((batch, vocab), g)
    args = (logits, temperature, top_p, top_k, exponentials)
    got = kernel_sampling.sample_tokens(*_to(DEVICE, *args)).cpu()
    assert got.tolist() == reference.sample_tokens(*args).tolist()


@pytest.mark.parametrize("top_p, top_k", [(0.0, 5), (0.6, 0), (0.75, 6)], ids=["k5", "p0.6", "p0.75-k6"])
def test_top_k_top_p_keep_exactly_the_reference_set_with_ties(top_p: float, top_k: int, monkeypatch) -> None:
    """Logits on a coarse grid (many exact ties, as in bf16) and two -inf entries.

    Row t of the batch gives token t an exponential of 1e-30 and every other token 1, so the race
    returns t exactly when p_t > 0: the batch reads the kept set token by token, which must be the
    reference's, ties at the cut-off broken by the lower token id. Tiles of 16 tokens make the ties
    span tiles.
    """
    monkeypatch.setattr(kernel_verify, "MAX_BLOCK", 16)
    vocab = 21
    g = torch.Generator().manual_seed(17)
    row = torch.randint(-3, 4, (vocab,), generator=g).float() / 2  # [vocab], 7 distinct values
    row[[4, 19]] = float("-inf")
    logits = row.expand(vocab, vocab)  # [vocab, vocab]: one row per probed token
    exponentials = torch.ones(vocab, vocab)  # [vocab, vocab]
    exponentials.fill_diagonal_(1e-30)
    params = (torch.ones(vocab), torch.full((vocab,), top_p), torch.full((vocab,), top_k, dtype=torch.long))
    kept = target_probs(row[None, None], *[t[:1] for t in params])[0, 0] > 0  # [vocab]
    got = kernel_sampling.sample_tokens(*_to(DEVICE, logits, *params, exponentials)).cpu()  # [vocab]
    assert (got == torch.arange(vocab)).tolist() == kept.tolist()
    assert got.tolist() == reference.sample_tokens(logits, *params, exponentials).tolist()


# Compiles the kernels for a Hopper GPU (sm_90) down to a cubin, no GPU needed: the interpreter
# runs Python semantics and would not notice code that only the compiler rejects (a loop-carried
# value changing type, an unsupported construct). Run in a fresh process, away from the
# interpreter mode of this module, with its own Triton cache so nothing stale is reused.
_AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.verify as kv

pointers = {"logits_ptr": None, "draft_ptr": "*i64", "q_ids_ptr": "*i64", "q_probs_ptr": "*fp32",
            "temperature_ptr": "*fp32", "top_p_ptr": "*fp32", "top_k_ptr": "*i64", "uniforms_ptr": "*fp32",
            "exponentials_ptr": "*fp32", "num_draft_ptr": "*i64", "accept_ptr": "*i8", "candidate_ptr": "*i64",
            "k": "i32", "vocab": "i32", "m": "i32", "greedy_temperature": "fp32"}
for dtype, m_pad in (("bf16", 1), ("fp32", 8)):
    signature = {**pointers, "logits_ptr": "*" + dtype,
                 "BLOCK": "constexpr", "M_PAD": "constexpr", "NUM_PIVOTS": "constexpr"}
    constants = {"BLOCK": 1024, "M_PAD": m_pad, "NUM_PIVOTS": kv.NUM_PIVOTS}
    source = ASTSource(kv._verify_rows_kernel, signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert compiled.asm["cubin"], dtype
signature = {"accept_ptr": "*i8", "candidate_ptr": "*i64", "num_accepted_ptr": "*i64", "next_token_ptr": "*i64",
             "k": "i32", "K_PAD": "constexpr"}
source = ASTSource(kv._commit_kernel, signature, constexprs={"K_PAD": 16})
assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
print("compiled")
"""


def test_kernels_compile_for_hopper_without_a_gpu(tmp_path) -> None:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


def test_cpu_devices_verify_row_by_row() -> None:
    verifier = select_verifier("cpu")
    assert verifier.backend == "rowwise"
    assert verifier.token_draws(2, 262144, torch.Generator().manual_seed(0)).shape == (2, 1)
    assert select_verifier("meta").backend == "reference"


# --------------------------------------------------------------------------- statistics


def _tv_bound(probs: torch.Tensor, n: int) -> float:
    """4x the mean TV of an exact sampler's empirical distribution of n draws from ``probs``."""
    probs = probs.double()
    return 4.0 * 0.5 * torch.sqrt(2 * probs * (1 - probs) / (torch.pi * n)).sum().item()


def _assert_distributed_as(samples: torch.Tensor, probs: torch.Tensor, label: str) -> None:
    """``samples`` [n] int64 are draws from ``probs`` [vocab] (chi-square and TV, module doc)."""
    n, vocab = samples.numel(), probs.shape[0]
    counts = torch.bincount(samples, minlength=vocab).double()  # [vocab]
    probs = probs.double()
    assert counts[probs == 0].sum() == 0, f"{label}: tokens outside p's support"
    p_value = chisquare(counts.numpy(), (probs / probs.sum() * n).numpy()).pvalue
    tv, bound = 0.5 * (counts / n - probs).abs().sum().item(), _tv_bound(probs, n)
    assert p_value > 1e-3 and tv < bound, f"{label}: chi-square p={p_value:.2e}, TV={tv:.4f} (bound {bound:.4f})"


def test_kernel_rejection_sampling_reproduces_p() -> None:
    vocab, k = 5, 1
    n = 200_000 if CUDA else 48
    g = torch.Generator().manual_seed(2024)
    row_logits = torch.tensor([[1.0, 0.2, -0.5, 0.8, -1.0], [0.0, 1.2, 0.3, -0.7, 0.5]])  # [k+1, vocab]
    q_row = torch.tensor([0.05, 0.1, 0.6, 0.05, 0.2])  # [vocab]: the draft favours an unlikely token
    draft = torch.multinomial(q_row, n, replacement=True, generator=g)[:, None]  # [n, 1]
    args = (
        row_logits.expand(n, k + 1, vocab),
        draft,
        torch.arange(vocab).expand(n, k, vocab),  # [n, 1, vocab]
        q_row.expand(n, k, vocab),  # [n, 1, vocab]
        torch.ones(n), torch.zeros(n), torch.zeros(n, dtype=torch.long),
        draw_uniforms((n, k), g), draw_exponentials((n, vocab), g),
    )
    num_accepted, token = [t.cpu() for t in kernel_verify.verify_chain(*_to(DEVICE, *args))]
    if not CUDA:  # a few interpreted blocks: the reference's commits, block for block
        want_accepted, want_token = reference.verify_chain(*args)
        assert num_accepted.tolist() == want_accepted.tolist() and token.tolist() == want_token.tolist()
        assert 0 < int(num_accepted.sum()) < n  # accepted and rejected drafts both
        return
    p = torch.softmax(row_logits, -1)  # [k+1, vocab]
    _assert_distributed_as(torch.where(num_accepted == 1, draft[:, 0], token), p[0], "first token")
    _assert_distributed_as(token[num_accepted == 1], p[1], "bonus token")
    # Power: committing the draft token unconditionally is far outside the bound at this n.
    assert 0.5 * (q_row - p[0]).abs().sum().item() > 2 * _tv_bound(p[0], n)


# --------------------------------------------------------------------------- GPU only

gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_gpu_selects_triton() -> None:
    assert select_verifier("cuda").backend == "triton"
    assert select_verifier("cuda:0").verify_chain is kernel_verify.verify_chain


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_llama3_vocabulary_matches_reference(dtype: torch.dtype) -> None:
    """Compiled kernel, Llama-3 vocabulary, the mixed batch (every path) on the GPU."""
    args, num_draft = _mixed_batch(128_256, dtype, seed=1)
    args = _to("cuda", *args)
    got = kernel_verify.verify_chain(*args, num_draft.cuda())
    want = reference.verify_chain(*args, num_draft.cuda())
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


@pytest.mark.gpu
@gpu
def test_gpu_one_compilation_serves_every_block_size() -> None:
    """k and m are not specialised: blocks of any length reuse one compiled kernel per tile size."""
    args, _ = _mixed_batch(128_256, torch.bfloat16, seed=2)
    args = _to("cuda", *args)
    kernel_verify.verify_chain(*args)
    compiled = _compiled_variants()
    for k in (1, 2):
        logits, draft, q_ids, q_probs, *rest = args
        kernel_verify.verify_chain(logits[:, : k + 1].contiguous(), draft[:, :k].contiguous(), q_ids[:, :k].contiguous(),
                                   q_probs[:, :k].contiguous(), *rest[:3], rest[3][:, :k].contiguous(), rest[4])
    assert _compiled_variants() == compiled


def _compiled_variants() -> int:
    """Compiled specialisations of the row kernel (Triton's per-device kernel caches)."""
    return sum(len(caches[0]) for caches in kernel_verify._verify_rows_kernel.device_caches.values())
