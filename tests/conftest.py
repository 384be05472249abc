"""Shared fixtures: tiny random-weight checkpoints (session-scoped, built once per run)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiny import make_tiny_model  # noqa: E402  (tests/ is on sys.path via this conftest)

# Keep model caches of a test run out of the user's home unless a cache is given explicitly.
os.environ.setdefault("TANDEM_CACHE_DIR", str(Path.home() / ".cache" / "tandem"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Llama target (seed 0)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-target"), seed=0, arch="llama")


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """A tiny Llama draft with different weights (seed 1) and the same tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1, arch="llama")


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory) -> Path:
    """A tiny Gemma 3 target with a sliding window of 8 on two of every three layers."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma"), seed=2, arch="gemma3", num_layers=3, sliding_window=8)


@pytest.fixture(scope="session")
def gemma_spec() -> str:
    """The real built-in default target (converted once into the tandem cache)."""
    return "gemma-3-270m"
