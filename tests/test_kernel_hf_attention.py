"""Tree attention inside transformers models (``kernels.hf_attention``), over the target's own cache.

A tiny Llama and a tiny Gemma 3 (sliding window 8 on two of three layers) run in float32 over a
``DynamicCache()`` built without config, as ``target_service.kv_cache`` builds it:

- chain forwards (prefill, verify blocks, a decode step) with tree attention installed give the
  logits of transformers' SDPA model (1e-5), through the reference (``NAME`` on CPU), through the
  kernel (``NAME_TRITON``, interpreted here) and through SDPA for a long prompt;
- a tree forward (``tree_forward`` + ``tree_position_ids``) gives, for every node, the logits
  of running that node's root-to-node path as a chain after the same prefix (2e-5): paths longer
  than the window, so the window cuts through the block.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_kernel_tree_attention import _interpreter_while_running, kernel  # noqa: F401  (autouse; interpreted)
from transformers import AutoModelForCausalLM, DynamicCache

from kernels import hf_attention
from kernels.hf_attention import NAME, NAME_REFERENCE, NAME_TRITON, install, tree_forward, tree_position_ids

ATOL = 2e-5  # float32 end to end; tiny models with sharpened (x4) weights give logits of order 10


@pytest.fixture(scope="module")
def models(tiny_dir, tiny_gemma_dir) -> dict:
    loaded = {}
    for arch, folder in (("llama", tiny_dir), ("gemma3", tiny_gemma_dir)):
        loaded[arch] = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return loaded


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _run(model, cache, token_ids, position_ids=None) -> torch.Tensor:
    """Logits ``[n, vocab]`` of one forward over ``token_ids`` after the cache (appended to it)."""
    position_ids = None if position_ids is None else position_ids.to(model.device)
    out = model(input_ids=torch.tensor([token_ids], device=model.device), position_ids=position_ids, cache=cache,
                use_cache=True)
    return out.logits[0]


def _chain_logits(model, name: str, prompt_len: int) -> list[torch.Tensor]:
    """Prefill, two verify-sized blocks and one decode step, under attention ``name``."""
    model.set_attn_implementation(name) if name == "sdpa" else install(model, name)
    cache = DynamicCache()
    steps = [_tokens(prompt_len, 0), _tokens(5, 1), _tokens(9, 2), _tokens(1, 3)]
    return [_run(model, cache, step) for step in steps]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("name, prompt_len", [(NAME, 20), (NAME, 45), (NAME_TRITON, 20), (NAME_REFERENCE, 12)])
def test_chain_forwards_match_transformers(models, arch, name, prompt_len, monkeypatch) -> None:
    """Prompt 20 (reference or kernel) or 45 (> MAX_KERNEL_QUERIES: SDPA under the mask), then blocks."""
    model = models[arch]
    want = _chain_logits(model, "sdpa", prompt_len)
    calls = []
    real = hf_attention._attention
    monkeypatch.setattr(hf_attention, "_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = _chain_logits(model, name, prompt_len)
    assert len(calls) == 4 * model.config.num_hidden_layers  # every layer of every forward went through us
    for step, (g, w) in enumerate(zip(got, want)):
        assert (g - w).abs().max().item() < ATOL, f"forward {step}"


# A chain of 10 (deeper than the window of 8) with branches off it, and a second branch family.
TREE = [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 10, 2, 12, 5, 14, 14]


def _path(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = TREE[node]
    return path[::-1]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("name", [NAME, NAME_TRITON])
def test_tree_forward_equals_each_path_as_a_chain(models, arch, name) -> None:
    model = install(models[arch], name)
    prefix = DynamicCache()
    _run(model, prefix, _tokens(12, 4))  # the committed prefix
    nodes = _tokens(len(TREE), 5)  # node 0 is the root (the last committed token)
    cache = copy.deepcopy(prefix)
    with tree_forward(TREE):
        tree_logits = _run(model, cache, nodes, tree_position_ids(TREE, 12))  # [n_q, vocab]
    assert cache.get_seq_length() == 12 + len(TREE)
    model.set_attn_implementation("sdpa")
    for node in range(len(TREE)):
        chain = _run(model, copy.deepcopy(prefix), [nodes[i] for i in _path(node)])[-1]  # [vocab]
        assert (tree_logits[node] - chain).abs().max().item() < ATOL, f"node {node} (depth {len(_path(node)) - 1})"


def test_without_a_tree_the_block_is_a_chain_and_mismatches_are_refused(models) -> None:
    model = install(models["llama"], NAME)
    cache = DynamicCache()
    _run(model, cache, _tokens(6, 6))
    chain = [-1, 0, 1, 2]
    with tree_forward(chain):
        explicit = _run(model, copy.deepcopy(cache), _tokens(4, 7), tree_position_ids(chain, 6))
    assert torch.allclose(explicit, _run(model, copy.deepcopy(cache), _tokens(4, 7)), atol=1e-6)
    with tree_forward([-1, 0, 0]), pytest.raises(ValueError, match="3 nodes"):
        _run(model, copy.deepcopy(cache), _tokens(4, 7))
    with pytest.raises(ValueError, match="parents"), tree_forward([-1, 3, 0]):
        pass
    assert hf_attention._TREE.get() is None  # the context is reset on the way out


def test_install_on_cuda_leaves_a_cpu_model_alone(tiny_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    before = model.config._attn_implementation
    assert hf_attention.install_on_cuda(model, "cpu") == before == model.config._attn_implementation


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_tree_forward_through_the_kernel(tiny_gemma_dir) -> None:
    """bf16 on the GPU: the kernel (picked by NAME itself) against the reference backend."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_gemma_dir), dtype=torch.bfloat16).cuda().eval()
    assert hf_attention.install_on_cuda(model, "cuda") == NAME
    results = []
    for name in (NAME, NAME_REFERENCE):
        install(model, name)
        cache = DynamicCache()
        _run(model, cache, _tokens(40, 8))
        with tree_forward(TREE):
            results.append(_run(model, cache, _tokens(len(TREE), 9), tree_position_ids(TREE, 40)).float())
    # bf16 logits of order 1 here, where eager and SDPA already differ by ~0.02.
    assert (results[0] - results[1]).abs().max().item() < 0.1
