"""The target engine driven through the Triton kernels (DESIGN §5: Triton on CUDA).

On CUDA the engine picks the kernels itself (``Info.verifier_backend == "triton"``); on CPU they
are put in its place, interpreted, so the plumbing between engine and kernels (shapes, dtypes,
devices, sparse q, top-k / top-p tensors) is exercised in CI as well.
"""

from __future__ import annotations

import pytest
import torch
from test_kernel_verify import CUDA, DEVICE, _interpreter_while_running, kernel_sampling, kernel_verify  # noqa: F401


def test_target_engine_on_the_kernels_stays_lossless(tiny_dir) -> None:
    """The target engine driven through the kernels (picked by the engine itself on CUDA, put in
    its place on CPU): greedy speculation with random drafts commits exactly transformers' greedy
    continuation, and a sampled session with top-k / top-p and a sparse q runs to its end."""
    pytest.importorskip("pydantic_settings", reason="the services' own dependencies are not installed here")
    from target_service.types import DraftBlock, SparseDist, VerdictStatus
    from target_service.engine import TargetEngine
    from target_service.session import SessionConfig
    from target_service.verifier import Verifier
    from tandem.models import load_model

    loaded = load_model(str(tiny_dir), device=DEVICE, dtype="float32")
    engine = TargetEngine(loaded)
    if CUDA:
        assert engine.info.verifier_backend == "triton"
    else:
        engine.runner.verifier = Verifier("triton", kernel_verify.verify_chain, kernel_sampling.sample_tokens)
    prompt = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        expected = loaded.model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=24, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    engine.prefill("greedy", prompt, SessionConfig(max_new_tokens=24, ignore_eos=True))
    session = engine.store.get("greedy")
    g = torch.Generator().manual_seed(1)
    while not session.finished:
        drafts = torch.randint(3, 300, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).tolist()
        assert engine.verify(DraftBlock("greedy", session.committed_len, tuple(drafts))).status == VerdictStatus.OK
    assert session.tokens[len(prompt):] == expected

    config = SessionConfig(max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=3, ignore_eos=True)
    engine.prefill("sampled", prompt, config)
    session = engine.store.get("sampled")
    q = SparseDist((5, 6, 7), (0.5, 0.3, 0.2))  # [m = 3] ids, the draft tokens among them
    while not session.finished:
        assert engine.verify(DraftBlock("sampled", session.committed_len, (5, 6), draft_probs=(q, q))).status == VerdictStatus.OK
    assert len(session.tokens) == len(prompt) + 8
