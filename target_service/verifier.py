"""Which implementation of the verification and sampling ops the engine calls.

DESIGN §5: the fused Triton kernels of ``kernels/`` on CUDA, their PyTorch references in
``kernels/reference/`` elsewhere. Both share one signature, so the engine never knows which it has;
``Info`` reports the choice as ``verifier_backend``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import reference

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verifier:
    backend: str  # "reference" or "triton": reported by Info
    verify_chain: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # see kernels.reference.verify_chain
    sample_tokens: Callable[..., torch.Tensor]  # see kernels.reference.sample_tokens


def select_verifier(device: str) -> Verifier:
    """The verifier for a model on ``device``: Triton on a CUDA device when Triton imports.

    The kernels are imported only here and only for CUDA, so a CPU service never compiles or
    interprets Triton code, and a broken Triton install degrades to the reference with a warning
    instead of failing the service.
    """
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        try:
            from kernels.sampling import sample_tokens
            from kernels.verify import verify_chain
        except Exception as error:  # noqa: BLE001 (ImportError, or Triton failing to find its compiler/driver)
            log.warning("Triton kernels unavailable (%s); verifying with the PyTorch reference", error)
        else:
            return Verifier("triton", verify_chain, sample_tokens)
    return Verifier("reference", reference.verify_chain, reference.sample_tokens)
