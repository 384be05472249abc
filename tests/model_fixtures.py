"""Model fixtures shared by several test modules (a plugin named in conftest.py's ``pytest_plugins``).

Tiny random checkpoints loaded once per test module (``llama``, ``gemma``, ``target``, ``draft``, ...),
an eagle head for the tiny Llama, and the 5-token-vocabulary target of the sampling tests. A test
module that defines a fixture of the same name uses its own instead (e.g. ``target`` in
test_draft_eagle.py), so these names are only those whose users all want the definition here.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from draft_fakes import load_tiny
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tandem.models import LoadedModel, load_model

# The vocabulary size of ``small_vocab_target``.
VOCAB = 5


# -- Tiny Llama and Gemma 3 (test_target_engine.py, test_target_tree.py; ``llama`` also for the eagle head) --


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return load_model(str(tiny_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def gemma(tiny_gemma_dir):
    return load_model(str(tiny_gemma_dir), device="cpu", dtype="float32")


@pytest.fixture(params=["llama", "gemma3"])
def llama_or_gemma(request, llama, gemma):
    return llama if request.param == "llama" else gemma


# -- The speculation loop's target and drafts (test_draft_loop.py, test_draft_pipeline.py) --


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_tiny(tiny_dir)


@pytest.fixture(scope="module")
def draft(tiny_draft_dir):
    return load_tiny(tiny_draft_dir)


@pytest.fixture(scope="module")
def near_target(target):
    """The target with noise on its weights: a draft that agrees often but not always, so rounds
    accept every prefix length (0, partial, all)."""
    model = copy.deepcopy(target.model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1 * param.std())
    return dataclasses.replace(target, model=model)


# -- An eagle head for the tiny Llama (test_draft_ngram_first.py, test_draft_tree.py) --


@pytest.fixture(scope="module")
def head(llama, tmp_path_factory) -> Path:
    # A helper of that test module, imported here so that loading this plugin imports no test module.
    from test_draft_eagle import make_head

    return make_head(tmp_path_factory.mktemp("head"), llama)


# -- The 5-token-vocabulary target (test_target_sampling.py, test_draft_pipeline.py) --


@pytest.fixture(scope="module")
def small_vocab_target(tiny_dir: Path) -> LoadedModel:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(11)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # spread the logits so p is far from uniform
        model.lm_head.weight.mul_(10.0)
    # Any tokenizer will do for the fingerprint; the vocabulary comes from the model config.
    return LoadedModel("vocab5", model, AutoTokenizer.from_pretrained(tiny_dir), tiny_dir, "float32", "cpu")


@pytest.fixture
def one_thread():
    """Thousands of passes of a 1-layer model: one thread is faster than two (no OpenMP barriers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
