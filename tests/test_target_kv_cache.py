"""KV cache rollback: after any sequence of block passes and rollbacks, the cache computes exactly
what a fresh forward pass over the committed tokens computes, including past Gemma 3's window."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.models import load_model
from target_service import kv_cache


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tiny_dir, tiny_gemma_dir):
    folder = tiny_dir if request.param == "llama" else tiny_gemma_dir
    return load_model(str(folder), device="cpu", dtype="float32").model


@torch.inference_mode()
def _logits(model, token_ids: list[int], cache=None) -> torch.Tensor:
    out = model(input_ids=torch.tensor([token_ids]), cache=cache, use_cache=cache is not None)
    return out.logits[0]  # [len(token_ids), vocab]


def test_rollback_matches_a_fresh_forward_pass(model) -> None:
    vocab = model.config.vocab_size
    rng = random.Random(0)
    committed = [rng.randrange(3, vocab) for _ in range(12)]  # longer than the sliding window of 8
    cache = kv_cache.new_cache()
    _logits(model, committed[:-1], cache)
    for _ in range(25):  # ~60 more tokens: many windows' worth of rollbacks
        block = [rng.randrange(3, vocab) for _ in range(rng.randint(0, 5))]
        block_logits = _logits(model, [committed[-1], *block], cache)  # [len(block)+1, vocab]
        # Compare with a full recomputation of the same positions (no cache at all).
        fresh = _logits(model, committed + block)[-len(block) - 1 :]
        torch.testing.assert_close(block_logits, fresh, atol=1e-4, rtol=1e-4)
        accepted = rng.randint(0, len(block))
        committed += block[:accepted] + [rng.randrange(3, vocab)]
        kv_cache.truncate(cache, len(committed) - 1)
        assert kv_cache.cache_length(cache) == len(committed) - 1


def test_truncate_refuses_to_grow(model) -> None:
    cache = kv_cache.new_cache()
    _logits(model, [5, 6, 7], cache)
    with pytest.raises(ValueError):
        kv_cache.truncate(cache, 4)
    kv_cache.truncate(cache, 3)  # no-op
    kv_cache.truncate(cache, 0)
    assert kv_cache.cache_length(cache) == 0


def test_layers_write_in_place_and_read_as_the_concatenation_would() -> None:
    """Random appends and rollbacks across several growths: every layer reads exactly what
    transformers' concatenating layer reads, and growth keeps the room it promised."""
    rng = random.Random(0)
    ours, theirs = kv_cache.new_cache(), kv_cache.DynamicCache()
    buffers, longest = set(), 0
    for step in range(60):
        n = rng.choice([1, 1, 2, 5, 40, 130])
        for layer in range(2):
            k, v = torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)  # [batch, kv_heads, n, head_dim]
            got, want = ours.update(k, v, layer), theirs.update(k, v, layer)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert isinstance(ours.layers[0], kv_cache.GrowableLayer)
        buffers.add(ours.layers[0]._key_buffer.data_ptr())
        longest = max(longest, kv_cache.cache_length(ours))
        if rng.random() < 0.5 and kv_cache.cache_length(ours) > 3:
            keep = rng.randrange(1, kv_cache.cache_length(ours))
            kv_cache.truncate(ours, keep)
            kv_cache.truncate(theirs, keep)
        assert kv_cache.cache_length(ours) == kv_cache.cache_length(theirs)
        # a rollback keeps the room; growth never takes more than the spare past the longest
        assert ours.layers[1]._key_buffer.shape[-2] <= longest + kv_cache.SPARE_POSITIONS
    assert 1 < len(buffers) < 30  # it grew, but not at every step
