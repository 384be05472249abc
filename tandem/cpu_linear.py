"""Linear layers on CPU as weights-stationary products for the few rows decoding computes.

Decoding multiplies 1 to k+1 rows by every weight matrix, so a step is bound by reading the
weights once (gemma-3-270m in float32: 400 MB of layers and a 671 MB [262144, 640] LM head).
``F.linear(x, W)`` computes ``x @ W.T``, and for a handful of rows MKL's transposed-B path runs
far below memory bandwidth; ``(W @ x.T).T`` streams W row by row instead. Measured on a 2-core
AVX-512 machine for the gemma LM head: 41 ms for one row and 88 ms for six with ``F.linear``, 19 ms
for one to four rows and 36 ms for six this way. A whole gemma-3-270m forward pass falls from 70 to
37 ms for one token and from 123 to 42 ms for four. MKL's one- and three-column products are slower
than its two- and four-column ones, so odd chunks get one row of padding, and rows go in chunks of
four, the widest product MKL runs at bandwidth (five to eight columns cost as much as two chunks).

It is the same arithmetic up to float summation order (differences ~1e-5 on logits of ~30, the
size of the differences ``F.linear`` itself has between one row and six), and the engine computes
every logit of a session, autoregressive or verifying, through this one path.

Only float32 weights on CPU in inference are changed: bfloat16 already runs at bandwidth there,
CUDA has its own GEMMs, and training keeps autograd's usual path. Products of more than
``MAX_ROWS`` rows (prefill) keep ``F.linear``, whose blocked GEMM is as fast there.
"""

from __future__ import annotations

import logging
from types import MethodType

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CHUNK_ROWS = 4  # the widest product MKL runs at memory bandwidth (measured: 5 to 8 cost 2 passes)
MAX_ROWS = 16  # beyond this F.linear is as fast (measured crossover: 12 to 24 rows)


def install_cpu_linears(model: torch.nn.Module, device: str) -> int:
    """Makes every float32 ``nn.Linear`` of a CPU model use ``few_row_linear``; returns how many."""
    if torch.device(device).type != "cpu":
        return 0
    installed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32:
            module.forward = MethodType(_linear_forward, module)
            installed += 1
    log.debug("%d linear layers use the weights-stationary few-row product", installed)
    return installed


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed as ``weight @ rows.T`` when x has few rows."""
    rows = x.reshape(-1, x.shape[-1])  # [m, in]
    m = rows.shape[0]
    if (
        m == 0
        or m > MAX_ROWS
        or rows.dtype != weight.dtype
        or weight.device.type != "cpu"
        or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
    ):
        return F.linear(x, weight, bias)
    parts = []
    for start in range(0, m, CHUNK_ROWS):
        chunk = rows[start : start + CHUNK_ROWS]  # [c, in]
        # MKL's one- and three-column products are slower than its two- and four-column ones.
        padded = torch.cat([chunk, chunk[:1]]) if chunk.shape[0] % 2 else chunk  # [c rounded up to even, in]
        parts.append((weight @ padded.T).T[: chunk.shape[0]])  # [c, out]
    out = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()  # [m, out]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return few_row_linear(x, self.weight, self.bias)
