"""The engine on the real default target, gemma-3-270m: greedy verification equals transformers'
greedy generate() token for token, with a prompt and a generation that cross the model's
512-token sliding window (KV rollback must stay correct past it)."""

from __future__ import annotations

import pytest
import torch

from tandem.models import load_model
from target_service.api import OK, DraftBlock
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
    engine = TargetEngine(gemma)
    assert engine.greedy_head is not None  # greedy tokens come from the screened LM head here
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
        assert verdict.status == OK
        accepted += verdict.num_accepted
    assert session.tokens[len(prompt) :] == reference
    assert accepted > NEW_TOKENS // 2  # the repeated code is predictable: most drafts were accepted
