"""Shared fixtures: tiny random-weight checkpoints (session-scoped, built once per run)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tiny import make_tiny_model  # tests/ is on sys.path (this conftest's folder)

# Fixtures shared by several test modules live in these helper modules (tests/ is on sys.path).
pytest_plugins = ["gateway_fakes", "model_fixtures"]

# Keep model caches of a test run out of the user's home unless a cache is given explicitly.
os.environ.setdefault("TANDEM_CACHE_DIR", str(Path.home() / ".cache" / "tandem"))


def _import_triton_interpreted() -> None:
    """Without CUDA the kernel tests run under Triton's interpreter, which Triton picks when a
    function is decorated: for ``triton.language``'s own helpers (``tl.sum``, ``tl.cumsum``, ...)
    at Triton's first import, for the kernels at theirs. transformers may import Triton with some
    models, so whichever test module came first used to decide, and the kernel tests failed after
    some others ("Cannot call @triton.jit'd outside of the scope of a kernel"). So Triton and the
    kernels are imported here, before any test module, with TRITON_INTERPRET=1 set only around
    the import (other tests see the environment they had)."""
    import torch

    if torch.cuda.is_available():
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401

        import kernels.compact_kv
        import kernels.sampling
        import kernels.tree
        import kernels.tree_attention
        import kernels.verify  # noqa: F401
    except ImportError:  # no Triton here: the kernel tests say so themselves
        pass
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


_import_triton_interpreted()


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


@pytest.fixture(scope="session")
def tiny_gguf_gemma(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Gemma 3 (hidden size 256, for the K block types) and a GGUF file of its weights in
    every block type tandem computes on; the checkpoint holds the file's exact dequantization."""
    from tiny import make_tiny_gguf

    folder = tmp_path_factory.mktemp("tiny-gguf-gemma")
    hf_dir = make_tiny_model(folder / "hf", seed=3, arch="gemma3", num_layers=3, sliding_window=8, hidden_size=256)
    return hf_dir, make_tiny_gguf(hf_dir, folder / "tiny-gemma.gguf")


def onednn_packs_bfloat16() -> bool:
    """Whether oneDNN on this host packs a bfloat16 weight (AVX-512 hosts do; AVX2-only ones do not)."""
    from tandem.cpu.linear import pack_weight

    return pack_weight(torch_randn_bf16()) is not None


def torch_randn_bf16():
    import torch

    return torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


@pytest.fixture
def bf16_screen_packs(monkeypatch) -> bool:
    """Forces the probe's answer "oneDNN packs the bfloat16 screen" where this host says no: the
    screen's packed products become plain ones (``F.linear`` over the same bfloat16 copy), so the
    screen's planning and exactness are tested on every host. Returns whether the host packs itself."""
    import torch.nn.functional as F

    if onednn_packs_bfloat16():
        return True
    from tandem.cpu import screened_head

    def pack(weight):
        return weight.detach().clone() if weight.dtype == torch_randn_bf16().dtype else None

    def product(x, packed, bias=None):
        return F.linear(x, packed, bias)

    def padded(x, packed, bias=None):
        import torch

        rows = x.reshape(-1, x.shape[-1])
        pad = torch.cat([rows, rows.new_zeros(max(0, 4 - rows.shape[0]), rows.shape[1])])
        return F.linear(pad, packed, bias)[: rows.shape[0]].reshape(*x.shape[:-1], packed.shape[0])

    monkeypatch.setattr(screened_head, "pack_weight", pack)
    monkeypatch.setattr(screened_head, "packed_linear", product)
    monkeypatch.setattr(screened_head, "padded_linear", padded)
    return False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-hogs", type=int, default=0, metavar="N",
        help="keep N busy-loop processes running beside the tests (the suite must pass on a loaded "
             "machine: no test asserts a timing), e.g. `python -m pytest -m slow --cpu-hogs 2`",
    )


@pytest.fixture(scope="session", autouse=True)
def cpu_hogs(request: pytest.FixtureRequest):
    """The ``--cpu-hogs`` processes, for the whole session."""
    import subprocess
    import sys

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(request.config.getoption("--cpu-hogs"))]
    yield len(hogs)
    for hog in hogs:
        hog.kill()
        hog.wait()
