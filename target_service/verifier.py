"""Which implementation of the verification and sampling ops the engine calls.

DESIGN §5: Triton kernels on CUDA, their PyTorch references elsewhere. Until ``kernels/`` holds
the Triton versions (their own issue), every device uses the reference; the Triton issue adds its
branch to ``select_verifier`` and nothing else changes, since the signatures are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import reference


@dataclass(frozen=True)
class Verifier:
    backend: str  # "reference" or "triton": reported by Info
    verify_chain: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # see kernels.reference.verify_chain
    sample_tokens: Callable[..., torch.Tensor]  # see kernels.reference.sample_tokens


def select_verifier(device: str) -> Verifier:
    """The verifier for a model on ``device``."""
    del device  # every device runs the reference until the Triton kernels exist
    return Verifier("reference", reference.verify_chain, reference.sample_tokens)
