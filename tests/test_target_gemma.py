"""The engine on the real default target, gemma-3-270m: greedy verification equals transformers'
greedy generate() token for token (float32 weights), and the same engine's own autoregressive
decoding (the default: computed on the GGUF file's blocks), with a prompt and a generation that
cross the model's 512-token sliding window (KV rollback must stay correct past it)."""

from __future__ import annotations

import pytest
import torch

from tandem.models import load_model
from target_service.types import DraftBlock, VerdictStatus
from target_service.engine import TargetEngine
from target_service.session import SessionConfig

NEW_TOKENS = 32
TEXT = (
    "def binary_search(items, target):\n"
    '    """Return the index of target in the sorted list items, or -1."""\n'
    "    lo, hi = 0, len(items) - 1\n"
    "    while lo <= hi:\n"
    "        mid = (lo + hi) // 2\n"
    "        if items[mid] == target:\n"
    "            return mid\n"
    "        if items[mid] < target:\n"
    "            lo = mid + 1\n"
    "        else:\n"
    "            hi = mid - 1\n"
    "    return -1\n\n"
)


@pytest.fixture(scope="module")
def gemma(gemma_spec):
    return load_model(gemma_spec, device="cpu", dtype="float32")


def prompt_lookup(tokens: list[int], k: int) -> list[int]:
    """A prompt-lookup drafter: continue the latest earlier occurrence of the last 3 tokens."""
    tail = tokens[-3:]
    for start in range(len(tokens) - 4, -1, -1):
        if tokens[start : start + 3] == tail:
            return tokens[start + 3 : start + 3 + k]
    return []


@pytest.mark.slow
def test_greedy_verify_equals_generate_across_the_sliding_window(gemma) -> None:
    from conftest import onednn_packs_bfloat16

    engine = TargetEngine(gemma)
    # Greedy tokens come from the screened LM head where oneDNN packs its bfloat16 copy (AVX-512),
    # else from the float32 head (AVX2-only hosts): exact either way.
    assert (engine.runner.greedy_head is not None) == onednn_packs_bfloat16()
    info = engine.info
    assert (info.vocab_size, info.hidden_size, info.max_context_len) == (262144, 640, 32768)
    assert 1 in info.eos_token_ids and gemma.model.config.sliding_window == 512

    prompt = gemma.tokenizer(TEXT * 8).input_ids
    prompt = prompt[:500]  # the generation crosses position 512
    with torch.inference_mode():
        out = gemma.model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    reference = out[0, len(prompt) :].tolist()

    engine.prefill("s", prompt, SessionConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    session = engine.store.get("s")
    accepted = 0
    while not session.finished:
        drafts = prompt_lookup(session.tokens, 5) or [0, 0]  # a wrong block when lookup finds nothing
        verdict = engine.verify(DraftBlock("s", session.committed_len, tuple(drafts)))
        assert verdict.status == VerdictStatus.OK
        accepted += verdict.num_accepted
    assert session.tokens[len(prompt) :] == reference
    assert accepted > NEW_TOKENS // 2  # the repeated code is predictable: most drafts were accepted


@pytest.fixture(scope="module")
def gemma_quantized(gemma_spec):
    return load_model(gemma_spec, device="cpu", dtype="auto")


@pytest.mark.slow
def test_quantized_target_verification_equals_its_own_autoregressive_decoding(gemma_quantized) -> None:
    """The default target computes on the GGUF file's blocks; speculation is lossless against it."""
    engine = TargetEngine(gemma_quantized)
    assert engine.info.dtype == "quantized:Q4_K,Q5_0,Q6_K,Q8_0"
    prompt = gemma_quantized.tokenizer(TEXT * 8).input_ids[:500]
    config = SessionConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engine.prefill("ar", prompt, config)
    engine.generate("ar", NEW_TOKENS)
    reference = engine.store.get("ar").tokens[len(prompt) :]
    assert len(reference) == NEW_TOKENS

    engine.prefill("s", prompt, config)
    session = engine.store.get("s")
    while not session.finished:
        drafts = prompt_lookup(session.tokens, 5) or [0, 0]
        assert engine.verify(DraftBlock("s", session.committed_len, tuple(drafts))).status == VerdictStatus.OK
    assert session.tokens[len(prompt) :] == reference


@pytest.mark.slow
def test_quantized_logits_are_the_float32_checkpoints(gemma, gemma_quantized, monkeypatch) -> None:
    """With float32 activations (the AVX2 build runs on every x86 host this suite runs on) the
    blocks are the float32 dequantization bit for bit: teacher-forced logits over a code prompt
    differ only by the order of summation, and pick the same tokens. The default kernel (int8
    activations where the CPU has VNNI) stays near them."""
    monkeypatch.setenv("TANDEM_QUANT_KERNEL", "avx2")
    exact = load_model("gemma-3-270m", device="cpu", dtype="auto")
    ids = torch.tensor([gemma.tokenizer(TEXT).input_ids])
    with torch.inference_mode():
        dense = gemma.model(ids).logits[0]  # [n, vocab]
        float_activations = exact.model(ids).logits[0]
        default = gemma_quantized.model(ids).logits[0]
    torch.testing.assert_close(float_activations, dense, rtol=0, atol=2e-3)
    assert torch.equal(float_activations.argmax(-1), dense.argmax(-1))
    assert float((default - dense).norm() / dense.norm()) < 0.05  # perplexity: +0.3% (quant_quality.py)
    assert float((default.argmax(-1) == dense.argmax(-1)).float().mean()) > 0.95
