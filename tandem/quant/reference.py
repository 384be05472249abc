"""PyTorch references of the quantized CPU kernel: the semantics ``qmatmul.cpp`` must reproduce.

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
