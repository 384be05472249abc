"""Which implementation of the verification and sampling ops the engine calls.

DESIGN §5: the fused Triton kernels of ``kernels/`` on CUDA; on a CPU ``kernels/rowwise.py``,
which applies the rules of the PyTorch references (``kernels/reference/``) row by row and draws a
token from one uniform instead of one draw per vocabulary id (the serial CPU's way to the same
distribution). All share one signature, the token's random input made by the backend's own
``token_draws``, so the engine never knows which it has; ``Info`` reports the choice as
``verifier_backend``. Other devices (MPS, say) run the references themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import reference, rowwise

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verifier:
    backend: str  # "rowwise", "reference" or "triton": reported by Info
    verify_chain: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # see kernels.reference.verify_chain
    sample_tokens: Callable[..., torch.Tensor]  # see kernels.reference.sample_tokens
    # (batch, vocab_size, generator) -> the last random input of both (reference.token_draws)
    token_draws: Callable[[int, int, torch.Generator], torch.Tensor] = reference.token_draws


def select_verifier(device: str) -> Verifier:
    """The verifier for a model on ``device``: Triton on a CUDA device when Triton imports, the
    row-by-row twin on a CPU, the reference elsewhere (e.g. MPS).

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
    if torch.device(device).type == "cpu":
        return Verifier("rowwise", rowwise.verify_chain, rowwise.sample_tokens, rowwise.token_draws)
    return Verifier("reference", reference.verify_chain, reference.sample_tokens)
