"""PyTorch references of the quantized CPU kernels: the semantics ``qmatmul.cpp`` and ``decoder_ops.cpp`` reproduce.

``qmatmul`` has the native operator's signature (``torch.ops.tandem_quant.qmatmul``); both compute
``x @ W.T`` in float32 from the exactly dequantized weight, so they differ only in the order of
summation.
"""

from __future__ import annotations

import torch

from tandem.quant.tensor import TILES, QuantizedTensor, from_tiles, unpack


def dequantize(weight: QuantizedTensor) -> torch.Tensor:
    """[out, in] float32: ``scale * (q - zero) - mins`` per group, as gguf-py computes it."""
    if weight.layout == TILES:
        weight = from_tiles(weight)
    out, width = weight.shape
    values = (unpack(weight.packed, weight.bits, width) - weight.zero).float()  # [out, in]
    grouped = values.view(out, width // weight.group, weight.group) * weight.scale.float()[..., None]
    if weight.mins is not None:
        grouped = grouped - weight.mins[..., None]
    return grouped.reshape(out, width)


def qmatmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor | None,
    group: int,
    bits: int,
    zero: int,
    out_features: int,
) -> torch.Tensor:
    """x [rows, in] float32 -> [rows, out_features] float32."""
    weight = QuantizedTensor(packed, scale, mins, group, bits, zero, "reference")
    if weight.shape != (out_features, x.shape[1]):
        raise ValueError(f"weight {weight.shape} does not fit x {tuple(x.shape)} -> {out_features} features")
    return x @ dequantize(weight).T


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] float32 -> (int8 values [rows, in] as int32, scales [rows, in / group] float32):
    per group, ``max |x| / 127`` and ``round_half_even(x * (127 / max))``, in float32 as the kernel."""
    rows, width = x.shape
    grouped = x.reshape(rows, width // group, group)
    amax = grouped.abs().amax(dim=-1)  # [rows, groups]
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    values = torch.round(grouped * inv[..., None]).to(torch.int32).reshape(rows, width)
    return values, amax / 127.0


def qmatmul_int8_activations(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """What ``qmatmul_vnni.cpp`` computes (x [rows, in] float32 -> [rows, out]): the activations
    quantized per group to int8, exact integer products per group, scaled by the weight's and the
    activations' scales (in float64 here; the kernel's float32 differs by rounding only)."""
    rows_layout = from_tiles(weight) if weight.layout == TILES else weight
    out, width = rows_layout.shape
    group = rows_layout.group
    xq, sx = quantize_activations(x, group)  # [rows, in], [rows, groups]
    wq = (unpack(rows_layout.packed, rows_layout.bits, width) - rows_layout.zero).double()  # [out, in]
    products = torch.einsum("mgk,ngk->mng", xq.double().reshape(-1, width // group, group),
                            wq.reshape(out, width // group, group))  # [rows, out, groups], exact integers
    y = (products * rows_layout.scale.double()[None] * sx.double()[:, None]).sum(-1)  # [rows, out]
    if rows_layout.mins is not None:
        sums = x.double().reshape(-1, width // group, group).sum(-1)  # [rows, groups]
        y = y - sums @ rows_layout.mins.double().T
    return y.float()


# decoder_ops.cpp's references: the same arithmetic in PyTorch (the sums of squares in float64).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] normalised per row, times ``weight`` [dim]."""
    inverse = 1.0 / torch.sqrt((x.double().square().sum(-1, keepdim=True) / x.shape[-1]).float() + eps)
    return x * inverse * weight


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, post: torch.Tensor, pre: torch.Tensor, eps: float):
    """(hidden, normed): hidden = residual + rms_norm(x, post), normed = rms_norm(hidden, pre)."""
    hidden = residual + rms_norm(x, post, eps)
    return hidden, rms_norm(hidden, pre, eps)


def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float):
    """x [rows, heads, dim]: each head normalised, then rotated by cos/sin [rows, dim] (pairs j, j + dim/2)."""
    normed = rms_norm(x, weight, eps)
    half = x.shape[-1] // 2
    rotated = torch.cat([-normed[..., half:], normed[..., :half]], dim=-1)
    return normed * cos[:, None] + rotated * sin[:, None]


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up, gelu's tanh approximation."""
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] -> [rows] int64: each row's first largest value's index (NaN counts as largest)."""
    return x.argmax(dim=1)


def mask_rows(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [rows, n], bitmask [rows, ceil(n / 32)] int32 (bit j of word w: token 32 w + j allowed)
    -> a copy of logits with every token not allowed at -inf."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[..., None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)  # [rows, words * 32]
    return logits.masked_fill(~allowed[:, : logits.shape[1]], float("-inf"))
