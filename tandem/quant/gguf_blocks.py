"""GGUF's block types as :class:`~tandem.quant.tensor.QuantizedTensor`: integers and group scales.

Each reader splits a tensor's blocks ([rows, bytes per row] uint8, as ``gguf.GGUFReader`` gives
them) the way gguf-py's ``dequantize_blocks`` does, and keeps the integers and scales apart
instead of multiplying them out. The scales are the float32 values that dequantization multiplies
by (for the K types, the super-block's half-precision scale times the 6- or 8-bit sub-block one,
exact in float32), so ``dequantize`` of the result equals gguf-py's float32 dequantization bit for
bit; ``to_quantized(..., check=True)`` asserts it.

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (groups of 32, half-precision scales), Q4_K, Q5_K (groups of
32 inside super-blocks of 256, asymmetric) and Q6_K (groups of 16). Others (Q2_K, Q3_K, the IQ
types) are not read: a weight in one keeps its float32 dequantization.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tandem.quant.tensor import QuantizedTensor, pack

QK_K = 256  # elements per K-type super-block
# A reader: blocks [n_blocks, block_bytes] uint8 -> (integers [n_blocks, block_elems], zero,
# scale [n_blocks, block_elems // group] float16/float32, mins like scale float32 or None, group, bits).
Reader = Callable[[np.ndarray], tuple[np.ndarray, int, np.ndarray, np.ndarray | None, int, int]]


def _half(column: np.ndarray) -> np.ndarray:
    return column.view(np.float16)  # [n, 1]


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """gguf's nibble order: for each run of ``width`` bytes, the low nibbles then the high ones."""
    n = qs.shape[0]
    shifted = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (shifted & 0x0F).reshape(n, -1)


def _q8_0(blocks: np.ndarray):
    d, qs = np.hsplit(blocks, [2])
    return qs.view(np.int8), 0, _half(d), None, 32, 8


def _q4_0(blocks: np.ndarray):
    d, qs = np.hsplit(blocks, [2])
    return _nibbles(qs, 16), 8, _half(d), None, 32, 4


def _q4_1(blocks: np.ndarray):
    d, m, qs = np.hsplit(blocks, [2, 4])
    return _nibbles(qs, 16), 0, _half(d), -_half(m).astype(np.float32), 32, 4


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    words = qh.copy().view("<u4")  # [n, 1]
    return ((words >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, 32]


def _q5_0(blocks: np.ndarray):
    d, qh, qs = np.hsplit(blocks, [2, 6])
    return _nibbles(qs, 16) | (_fifth_bits(qh) << 4), 16, _half(d), None, 32, 5


def _q5_1(blocks: np.ndarray):
    d, m, qh, qs = np.hsplit(blocks, [2, 4, 8])
    return _nibbles(qs, 16) | (_fifth_bits(qh) << 4), 0, _half(d), -_half(m).astype(np.float32), 32, 5


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the eight sub-block scales and minimums (float32) and the rest of each block."""
    from gguf.quants import Q4_K

    d, dmin, scales, rest = np.hsplit(blocks, [2, 4, 4 + Q4_K.K_SCALE_SIZE])
    sc, m = Q4_K.get_scale_min(scales)
    scale = _half(d).astype(np.float32) * sc.astype(np.float32)  # [n, 8]
    mins = _half(dmin).astype(np.float32) * m.astype(np.float32)  # [n, 8]
    return scale, mins, rest


def _q4_k(blocks: np.ndarray):
    scale, mins, qs = _k_scales(blocks)
    return _nibbles(qs, 32), 0, scale, mins, 32, 4


def _q5_k(blocks: np.ndarray):
    scale, mins, rest = _k_scales(blocks)
    qh, qs = np.hsplit(rest, [QK_K // 8])
    n = blocks.shape[0]
    high = qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # [n, 8, 32]: bit j of sub-block j
    return _nibbles(qs, 32) | ((high & 1).reshape(n, -1) << 4), 0, scale, mins, 32, 5


def _q6_k(blocks: np.ndarray):
    ql, qh, scales, d = np.hsplit(blocks, [QK_K // 2, QK_K // 2 + QK_K // 4, QK_K // 2 + QK_K // 4 + QK_K // 16])
    n = blocks.shape[0]
    scale = _half(d).astype(np.float32) * scales.view(np.int8).astype(np.float32)  # [n, 16]
    low = _nibbles(ql, 64)  # [n, 256]
    shifted = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (shifted & 0x03).reshape(n, -1)  # [n, 256]
    values = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return values, 0, scale, None, 16, 8


READERS: dict[str, Reader] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def supported(type_name: str) -> bool:
    return type_name in READERS


def to_quantized(raw: np.ndarray, type_name: str, shape: tuple[int, int], check: bool = False) -> QuantizedTensor:
    """A GGUF tensor's blocks (``raw``: [out, bytes per row] uint8) as a QuantizedTensor of ``shape``
    [out, in]. ``check``: assert that it dequantizes to gguf-py's float32 values exactly."""
    import gguf

    out, width = shape
    qtype = gguf.GGMLQuantizationType[type_name]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if width % block_elems or raw.size != out * width // block_elems * block_bytes:
        raise ValueError(f"{type_name} tensor of {raw.size} bytes does not hold a [{out}, {width}] weight")
    blocks = np.ascontiguousarray(raw).reshape(-1, block_bytes)  # [n_blocks, block_bytes]
    values, zero, scale, mins, group, bits = READERS[type_name](blocks)
    weight = QuantizedTensor(
        packed=torch.from_numpy(pack(values.reshape(out, width), bits)),
        scale=torch.from_numpy(np.ascontiguousarray(scale.reshape(out, width // group))),
        mins=None if mins is None else torch.from_numpy(np.ascontiguousarray(mins.reshape(out, width // group))),
        group=group, bits=bits, zero=zero, source=type_name,
    )
    if check:
        from tandem.quant.reference import dequantize

        expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(out, width))
        if not torch.equal(dequantize(weight), expected):
            raise AssertionError(f"{type_name}: the repacked blocks do not dequantize to gguf-py's values")
    return weight


def from_float(weight: torch.Tensor, type_name: str = "Q8_0") -> QuantizedTensor:
    """A float weight [out, in] quantized by gguf-py's own quantizer into ``type_name`` (one of the
    types gguf-py quantizes itself: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; ``in`` a multiple of 32)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(weight.detach().float().cpu().numpy(), qtype)
    return to_quantized(raw, type_name, (int(weight.shape[0]), int(weight.shape[1])))
