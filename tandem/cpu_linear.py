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
size of the differences ``F.linear`` itself has between one row and six, and MKL's two- and
four-column products between each other), and the engine computes every logit of a session,
autoregressive or verifying, through this one path.

Four-column products over a long inner dimension fall off that path: gemma's MLP down projection
([640, 2048]) takes 0.33 ms for four rows against 0.14 ms for two, while its [640, 1024] attention
output projection costs the same for both (one row panel of four columns past 16 KB, it seems,
leaves the L1 cache). Such weights also keep a copy cut along the inner dimension into contiguous
[out, 1024] slices, and four-column products sum the slices' products: 0.14 ms again, so a forward
pass over three or four tokens falls from 41-45 to 37-40 ms (one or two tokens: 35-37 ms, unchanged;
measured interleaved in one process).
The copy costs the weight's size once more (94 MB for gemma-3-270m), so it is made only up to
``MAX_SPLIT_BYTES`` per model, and it is taken when installed: weights changed later (in place,
outside autograd) need ``install_cpu_linears`` again.

The LM head hands back its logits as the transposed view of the product ([rows, vocab] with
strides (1, columns)) rather than a contiguous copy: consumers reduce over the vocabulary
(argmax, softmax), which reads a strided row as fast, and copying 262k x 2 or 4 floats cost 0.8 to
1.3 ms of a gemma-3-270m pass. Layers inside the model keep contiguous outputs, which the
attention code reshapes with ``view``.

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
K_SLICE = 1024  # inner-dimension slice of the split copies (four columns x 1024 floats: 16 KB)
MAX_SPLIT_BYTES = 256 * 2**20  # the most memory the split copies of one model may take


def install_cpu_linears(model: torch.nn.Module, device: str) -> int:
    """Makes every float32 ``nn.Linear`` of a CPU model use ``few_row_linear``; returns how many."""
    if torch.device(device).type != "cpu":
        return 0
    installed = 0
    split_bytes = 0
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32:
            module.forward = MethodType(_linear_forward, module)
            module.few_row_contiguous = module is not head
            installed += 1
            weight = module.weight
            size = weight.numel() * weight.element_size()
            if weight.shape[1] > K_SLICE and split_bytes + size <= MAX_SPLIT_BYTES:
                module.few_row_slices = split_inner(weight.detach())
                split_bytes += size
    log.debug("%d linear layers use the weights-stationary few-row product (%.0f MB of split copies)",
              installed, split_bytes / 2**20)
    return installed


def split_inner(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``weight`` [out, in] cut along ``in`` into contiguous [out, <= K_SLICE] copies."""
    return tuple(weight[:, start : start + K_SLICE].contiguous() for start in range(0, weight.shape[1], K_SLICE))


def few_row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    slices: tuple[torch.Tensor, ...] | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed as ``weight @ rows.T`` when x has few rows.

    ``slices`` (from :func:`split_inner` of the same weight) serve the four-column products.
    ``contiguous=False`` may return a transposed view (the same values, strides (1, columns))."""
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
        if slices is not None and padded.shape[0] > 2:
            product = _sliced_product(slices, padded)  # [out, c]
        else:
            product = weight @ padded.T  # [out, c]
        parts.append(product.T[: chunk.shape[0]])  # [c, out]
    if len(parts) > 1:
        out = torch.cat(parts)  # [m, out]
    else:
        out = parts[0].contiguous() if contiguous else parts[0]  # [m, out]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _sliced_product(slices: tuple[torch.Tensor, ...], rows: torch.Tensor) -> torch.Tensor:
    """``weight @ rows.T`` [out, c] as the sum of each inner slice's product."""
    out = None
    start = 0
    for piece in slices:  # [out, width]
        width = piece.shape[1]
        product = piece @ rows[:, start : start + width].T  # [out, c]
        out = product if out is None else out.add_(product)
        start += width
    return out


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return few_row_linear(x, self.weight, self.bias, getattr(self, "few_row_slices", None),
                          getattr(self, "few_row_contiguous", True))
