"""A model computed on its GGUF file's own blocks (tandem.quant.checkpoint, tandem.models): which
modules are swapped, the cache of repacked blocks, the float32 fallbacks, and losslessness of
speculative decoding against the same quantized model's autoregressive decoding."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import models
from tandem.models import specs
from tandem.quant import checkpoint
from tandem.quant import reference as quant_reference
from tandem.quant.checkpoint import BLOCKS_FILE, quantize_model
from tandem.quant.modules import DENSE_ROWS, QuantEmbedding, QuantLinear
from tandem.quant.native import QuantKernel, load_kernel, runs_here
from target_service.types import DraftBlock, VerdictStatus
from target_service.engine import TargetEngine
from target_service.session import SessionConfig
from tiny import TINY_GGUF_TYPES

NEW_TOKENS = 24


def _float_model(hf_dir: Path):
    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


@pytest.fixture
def blocks_file(tmp_path: Path) -> Path:
    return tmp_path / BLOCKS_FILE


# Both kinds of kernel, each where this CPU runs it: float32 activations (the AVX2 build) and int8
# activations (the AVX2 and the AVX-512 VNNI builds).
KERNELS = [pytest.param(isa, marks=pytest.mark.skipif(not runs_here(isa), reason=f"this CPU lacks {isa}"))
           for isa in ("avx2", "avx2int8", "avx512vnni")]


@pytest.fixture(params=KERNELS)
def kernel(request) -> QuantKernel:
    return load_kernel(request.param)


def test_every_linear_and_the_embedding_compute_on_the_files_blocks(tiny_gguf_gemma, blocks_file, kernel) -> None:
    hf_dir, gguf_path = tiny_gguf_gemma
    model, reference = _float_model(hf_dir), _float_model(hf_dir)
    summary = quantize_model(model, gguf_path, blocks_file, kernel)
    assert summary.kept_float == {}
    assert sorted(summary.by_type) == sorted(set(TINY_GGUF_TYPES.values()))
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.packed is model.model.embed_tokens.packed  # the tied head shares the embedding's blocks
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert summary.dtype == "quantized:" + ",".join(sorted(set(TINY_GGUF_TYPES.values())))
    ids = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, want = model(ids).logits, reference(ids).logits
    if kernel.activations == "float32":
        # The same weights bit for bit; only the order of summation differs.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    else:
        # int8 activations (per group of 32, as llama.cpp): each swapped layer computes its reference
        # semantics on the activations the forward gave it; the model as a whole is near the float32
        # checkpoint, not equal (this random model amplifies every rounding; the real model's quality
        # is benchmarks/quant_quality.py's).
        seen = []

        def check(module, inputs, output):
            rows = inputs[0].reshape(-1, module.in_features).float().contiguous()
            want_rows = quant_reference.qmatmul_int8_activations(rows, module.quantized)
            torch.testing.assert_close(output.reshape(rows.shape[0], -1), want_rows, rtol=1e-4, atol=1e-3)
            seen.append(module)

        hooks = [m.register_forward_hook(check) for m in model.modules() if isinstance(m, QuantLinear)]
        with torch.inference_mode():
            model(ids)
        for hook in hooks:
            hook.remove()
        assert len(seen) == sum(isinstance(m, QuantLinear) for m in model.modules())
        assert float((got - want).norm() / want.norm()) < 0.25


def test_repacked_blocks_are_cached_and_a_damaged_cache_is_made_again(tiny_gguf_gemma, blocks_file, monkeypatch) -> None:
    hf_dir, gguf_path = tiny_gguf_gemma
    quantize_model(_float_model(hf_dir), gguf_path, blocks_file, load_kernel())
    assert blocks_file.is_file()

    def no_reading(*_args):
        raise AssertionError("the cache should have been used, the GGUF file left unread")

    with monkeypatch.context() as patch:  # a start from the cache opens no GGUF file (gguf-py parses all of one)
        patch.setattr(checkpoint, "_repack", no_reading)
        patch.setattr(gguf, "GGUFReader", no_reading)
        summary = quantize_model(_float_model(hf_dir), gguf_path, blocks_file, load_kernel())
        assert summary.kept_float == {} and summary.swapped > 0
    blocks_file.write_bytes(b"not safetensors")
    assert quantize_model(_float_model(hf_dir), gguf_path, blocks_file, load_kernel()).kept_float == {}
    # A changed GGUF file (here: a new modification time) invalidates the cache.
    os.utime(gguf_path, ns=(gguf_path.stat().st_atime_ns, gguf_path.stat().st_mtime_ns + 1))
    repacked = []
    real = checkpoint._repack
    monkeypatch.setattr(checkpoint, "_repack", lambda path: repacked.append(path) or real(path))
    quantize_model(_float_model(hf_dir), gguf_path, blocks_file, load_kernel())
    assert repacked == [gguf_path]
    # A cache written before it kept the file's architecture is read again from the file.
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(blocks_file), framework="pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "architecture"}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    save_file(tensors, str(blocks_file), metadata=meta)
    quantize_model(_float_model(hf_dir), gguf_path, blocks_file, load_kernel())
    assert repacked == [gguf_path, gguf_path]


def test_a_weight_that_is_not_the_files_dequantization_keeps_float32(tiny_gguf_gemma, blocks_file) -> None:
    hf_dir, gguf_path = tiny_gguf_gemma
    model = _float_model(hf_dir)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0  # as if the conversion had transformed it
    summary = quantize_model(model, gguf_path, blocks_file, load_kernel())
    assert list(summary.kept_float) == ["model.layers.1.mlp.up_proj"]
    assert "differ from the converted weight" in summary.kept_float["model.layers.1.mlp.up_proj"]
    assert isinstance(model.model.layers[1].mlp.up_proj, torch.nn.Linear)
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)


def _resolve_to(monkeypatch, hf_dir: Path, gguf_path: Path) -> None:
    monkeypatch.setattr(specs, "resolve", lambda spec: specs.ResolvedSpec(spec, "tiny", hf_dir, gguf_path))


def test_dtype_auto_quantizes_and_float32_does_not(tiny_gguf_gemma, tmp_path, monkeypatch) -> None:
    hf_dir, gguf_path = tiny_gguf_gemma
    copy = tmp_path / "hf"  # the blocks file goes beside the checkpoint: a copy keeps the fixture clean
    copy.mkdir()
    for path in hf_dir.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    _resolve_to(monkeypatch, copy, gguf_path)
    quantized = models.load_model("tiny.gguf", device="cpu", dtype="auto")
    assert quantized.quantization.startswith("quantized:") and quantized.weights == quantized.quantization
    assert (copy / BLOCKS_FILE).is_file()
    dense = models.load_model("tiny.gguf", device="cpu", dtype="float32")
    assert dense.quantization == "" and dense.weights == "float32"
    assert isinstance(dense.model.lm_head, torch.nn.Linear)


def test_no_kernel_keeps_float32_and_says_why(tiny_gguf_gemma, monkeypatch, caplog) -> None:
    hf_dir, gguf_path = tiny_gguf_gemma
    _resolve_to(monkeypatch, hf_dir, gguf_path)
    monkeypatch.setenv("TANDEM_QUANT_KERNEL", "none")
    with caplog.at_level(logging.WARNING, logger="tandem.models"):
        loaded = models.load_model("tiny.gguf", device="cpu", dtype="auto")
    assert loaded.quantization == "" and isinstance(loaded.model.lm_head, torch.nn.Linear)
    assert "float32 dequantized weights instead" in caplog.text and "TANDEM_QUANT_KERNEL=none" in caplog.text


@pytest.fixture(scope="module", params=KERNELS)
def quantized_gemma(request, tiny_gguf_gemma, tmp_path_factory) -> models.LoadedModel:
    hf_dir, gguf_path = tiny_gguf_gemma
    model = _float_model(hf_dir)
    summary = quantize_model(model, gguf_path, tmp_path_factory.mktemp("blocks") / BLOCKS_FILE,
                             load_kernel(request.param))
    return models.LoadedModel("tiny-q", model, models.load_tokenizer(str(hf_dir)), hf_dir, "float32", "cpu",
                              summary.dtype)


def _prompt(seed: int, length: int = 20) -> list[int]:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_speculation_equals_the_quantized_models_own_decoding(quantized_gemma, k: int) -> None:
    """Lossless against the served model: verify blocks (random drafts, some right) commit exactly
    the tokens the same engine's autoregressive Generate gives, across the sliding window (8)."""
    engine = TargetEngine(quantized_gemma)
    assert engine.info.dtype.startswith("quantized:")
    prompt = _prompt(k)
    config = SessionConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engine.prefill("ar", prompt, config)
    reference = list(engine.generate("ar", NEW_TOKENS).token_ids)
    reference = engine.store.get("ar").tokens[len(prompt) :]
    assert len(reference) == NEW_TOKENS

    engine.prefill("spec", prompt, config)
    session = engine.store.get("spec")
    generator = torch.Generator().manual_seed(k)
    while not session.finished:
        done = session.committed_len - len(prompt)
        right = reference[done : done + k]
        drafts = [t if torch.rand(1, generator=generator) < 0.7 else (t + 1) % 300 for t in right]
        verdict = engine.verify(DraftBlock("spec", session.committed_len, tuple(drafts)))
        assert verdict.status == VerdictStatus.OK
    assert session.tokens[len(prompt) :] == reference


def test_a_long_prompt_chunk_takes_the_dense_product_and_agrees(quantized_gemma) -> None:
    """More than DENSE_ROWS rows (a prompt chunk) go through a float32 GEMM of the dequantized
    weight; the first token is the same as from a prefill in small chunks."""
    long_prompt = _prompt(99, DENSE_ROWS + 10)
    whole = TargetEngine(quantized_gemma, prefill_chunk_tokens=0)
    small = TargetEngine(quantized_gemma, prefill_chunk_tokens=8)
    config = SessionConfig(max_new_tokens=4, ignore_eos=True)
    assert whole.prefill("a", long_prompt, config).token_id == small.prefill("b", long_prompt, config).token_id
