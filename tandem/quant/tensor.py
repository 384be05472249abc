"""A weight kept as group-quantized integers, in the layouts the CPU kernel reads.

``W[n, k] = scale[n, g] * (q[n, k] - zero) - mins[n, g]`` with ``g = k // group``, computed in
float32. Every GGUF block type tandem computes on maps onto this exactly: the products are those
gguf-py's float32 dequantization computes, so ``dequantize`` (``tandem.quant.reference``) gives the
float32 checkpoint bit for bit. Layouts of ``packed`` ([out, row_bytes] uint8), per group of 32:

* ``bits=8``: one signed byte per weight (groups of 32 or 16);
* ``bits=4``: 16 bytes, byte i holding element i in its low nibble and element i + 16 in its high one;
* ``bits=5``: those 16 bytes for the low four bits, then a little-endian uint32 whose bit i is
  element i's fifth bit.

The AVX-512 VNNI kernel (``qmatmul_vnni.cpp``) reads another layout, ``TILES``, made from this one
by :func:`to_tiles`: output rows in tiles of 16, unsigned integers in blocks of [16 rows][4 inputs].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

LAYOUT_VERSION = 1  # bumped when a layout changes: cached repacks of an older version are made again
GROUP_BYTES = {4: 16, 5: 20}  # bytes per group of 32 in the sub-byte layouts
ROWS = "rows"  # the layout above, one output row after another
TILES = "tiles16"  # output rows in tiles of TILE, for vpdpbusd (qmatmul_vnni.cpp)
TILE = 16


@dataclass
class QuantizedTensor:
    """A [out, in] weight as integers with per-group scales (and, for asymmetric types, minimums)."""

    packed: torch.Tensor  # [out, row_bytes] uint8
    scale: torch.Tensor  # [out, in // group] float16 or float32
    mins: torch.Tensor | None  # [out, in // group] float32, or None (all zero)
    group: int
    bits: int  # 4, 5 or 8
    zero: int  # subtracted from every integer before scaling
    source: str  # the block type it came from ("Q4_K", "Q8_0", ...)
    layout: str = ROWS  # TILES: packed [tiles, groups, bytes] unsigned, scale/mins [tiles, groups, TILE]

    @property
    def shape(self) -> tuple[int, int]:
        if self.layout == TILES:
            return int(self.scale.shape[0]) * TILE, int(self.scale.shape[1]) * self.group
        return int(self.scale.shape[0]), int(self.scale.shape[1]) * self.group

    @property
    def nbytes(self) -> int:
        """What one product reads: the integers, the scales and the minimums."""
        extra = 0 if self.mins is None else self.mins.numel() * 4
        return self.packed.numel() + self.scale.numel() * self.scale.element_size() + extra

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The output rows ``index`` [r] (an embedding lookup reads only those), in the row layout."""
        if self.layout == TILES:
            tiles = index // TILE  # [r]
            picked = QuantizedTensor(self.packed.index_select(0, tiles), self.scale.index_select(0, tiles),
                                     None if self.mins is None else self.mins.index_select(0, tiles),
                                     self.group, self.bits, self.zero, self.source, TILES)
            return from_tiles(picked, within=index % TILE)
        return QuantizedTensor(
            self.packed.index_select(0, index),
            self.scale.index_select(0, index),
            None if self.mins is None else self.mins.index_select(0, index),
            self.group, self.bits, self.zero, self.source,
        )


def stackable(weights: list[QuantizedTensor]) -> bool:
    """Whether :func:`stack` can join ``weights``: one format, layout and input width."""
    first = weights[0]
    return all(
        (w.group, w.bits, w.zero, w.layout, w.scale.dtype, w.mins is None, w.shape[1], w.packed.shape[1:])
        == (first.group, first.bits, first.zero, first.layout, first.scale.dtype, first.mins is None,
            first.shape[1], first.packed.shape[1:])
        for w in weights
    )


def stack(weights: list[QuantizedTensor]) -> QuantizedTensor:
    """``weights`` [out_i, in] as one [sum(out_i), in] (rows, or tiles, end to end): one product
    reads them all, and each output row is computed exactly as in its own weight's product."""
    if not stackable(weights):
        raise ValueError("stack needs weights of one format, layout and input width")
    first = weights[0]
    return QuantizedTensor(
        torch.cat([w.packed for w in weights]), torch.cat([w.scale for w in weights]),
        None if first.mins is None else torch.cat([w.mins for w in weights]),
        first.group, first.bits, first.zero, "+".join(dict.fromkeys(w.source for w in weights)), first.layout,
    )


def row_bytes(in_features: int, bits: int) -> int:
    return in_features if bits == 8 else in_features // 32 * GROUP_BYTES[bits]


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Integers [out, in] (int8 for 8 bits, else unsigned below 2**bits) -> packed [out, row_bytes] uint8."""
    if bits == 8:
        return np.ascontiguousarray(values.astype(np.int8).view(np.uint8))
    out, width = values.shape
    groups = values.astype(np.uint8).reshape(out, width // 32, 32)  # [out, G, 32]
    low = (groups[..., :16] & 0x0F) | ((groups[..., 16:] & 0x0F) << 4)  # [out, G, 16]
    if bits == 4:
        return np.ascontiguousarray(low.reshape(out, -1))
    fifth = ((groups >> 4) & 1).astype(np.uint32)  # [out, G, 32]
    words = (fifth << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)  # [out, G]
    high = words.astype("<u4").view(np.uint8).reshape(out, width // 32, 4)  # [out, G, 4]
    return np.ascontiguousarray(np.concatenate([low, high], axis=-1).reshape(out, -1))


def unpack(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """The inverse of :func:`pack`: [out, row_bytes] uint8 -> [out, in] int32 integers."""
    out = packed.shape[0]
    if bits == 8:
        return packed.view(torch.int8).to(torch.int32)
    groups = packed.reshape(out, in_features // 32, GROUP_BYTES[bits]).to(torch.int32)  # [out, G, bytes]
    low = groups[..., :16]  # [out, G, 16]
    values = torch.cat([low & 0x0F, low >> 4], dim=-1)  # [out, G, 32]
    if bits == 5:
        word = sum(groups[..., 16 + i] << (8 * i) for i in range(4))  # [out, G]
        fifth = (word[..., None] >> torch.arange(32)) & 1  # [out, G, 32]
        values = values | (fifth << 4)
    return values.reshape(out, in_features)


def unsigned_bytes(weight: QuantizedTensor) -> torch.Tensor:
    """A row-layout weight's integers as the tiles store them, unsigned [out, in] uint8 (8-bit ones +
    128): :func:`unpack` without its int32 copy, which for a 262k-row head is most of a start's repacking."""
    out, width = weight.shape
    if weight.bits == 8:
        return weight.packed ^ 0x80  # int8 v as uint8, plus 128 modulo 256
    groups = weight.packed.reshape(out, width // 32, GROUP_BYTES[weight.bits])  # [out, G, bytes] uint8
    low = groups[..., :16]  # [out, G, 16]
    values = torch.cat([low & 0x0F, low >> 4], dim=-1)  # [out, G, 32]
    if weight.bits == 5:
        shifts = torch.arange(8, dtype=torch.uint8)  # element i's fifth bit: bit i % 8 of byte i // 8
        fifth = (groups[..., 16:, None] >> shifts) & 1  # [out, G, 4, 8]
        values |= fifth.reshape(out, width // 32, 32) << 4
    return values.reshape(out, width)


def _tile_zero(weight: QuantizedTensor) -> int:
    """The tiles' integers are unsigned: 8-bit ones carry +128, folded into ``zero``."""
    return weight.zero + (128 if weight.bits == 8 else 0)


def to_tiles(weight: QuantizedTensor) -> QuantizedTensor:
    """The same weight in the ``TILES`` layout (out must be a multiple of ``TILE``)."""
    out, width = weight.shape
    if weight.layout != ROWS or out % TILE:
        raise ValueError(f"to_tiles needs a row-layout weight with a multiple of {TILE} rows, got {weight.shape}")
    groups, group = width // weight.group, weight.group
    blocks = unsigned_bytes(weight).reshape(out // TILE, TILE, groups, group // 4, 4)  # uint8
    blocks = blocks.permute(0, 2, 3, 1, 4).contiguous()  # [tiles, groups, group/4, TILE, 4]
    if weight.bits == 8:
        packed = blocks.reshape(out // TILE, groups, -1)
    else:
        pairs = blocks.reshape(out // TILE, groups, group // 8, 2, TILE * 4)  # block 2c and 2c + 1 share chunk c
        low = (pairs[:, :, :, 0] & 0x0F) | ((pairs[:, :, :, 1] & 0x0F) << 4)  # [tiles, groups, group/8, 64]
        parts = [low.reshape(out // TILE, groups, -1)]
        if weight.bits == 5:
            fifth = ((blocks >> 4) & 1).to(torch.int64).reshape(out // TILE, groups, group // 4, 64)
            words = (fifth << torch.arange(64)).sum(-1)  # [tiles, groups, group/4]: bit 4 * row + i
            parts.append(words.view(torch.uint8).reshape(out // TILE, groups, -1))
        packed = torch.cat(parts, dim=-1)
    def transpose(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.reshape(out // TILE, TILE, groups).transpose(1, 2).contiguous()
    return QuantizedTensor(packed.contiguous(), transpose(weight.scale), transpose(weight.mins), group, weight.bits,
                           _tile_zero(weight), weight.source, TILES)


def from_tiles(weight: QuantizedTensor, within: torch.Tensor | None = None) -> QuantizedTensor:
    """The inverse of :func:`to_tiles`; with ``within`` [tiles] only that row of each tile (one
    tile per output row: an embedding lookup's rows, without unpacking the other fifteen)."""
    out, width = weight.shape
    tiles, groups, group = out // TILE, width // weight.group, weight.group
    packed = weight.packed.reshape(tiles, groups, -1)
    if weight.bits == 8:
        blocks = packed.reshape(tiles, groups, group // 4, TILE, 4).to(torch.int32)
    else:
        chunks = packed[..., : group * 8].reshape(tiles, groups, group // 8, 1, TILE * 4).to(torch.int32)
        blocks = torch.cat([chunks & 0x0F, chunks >> 4], dim=3).reshape(tiles, groups, group // 4, TILE, 4)
        if weight.bits == 5:
            words = packed[..., group * 8 :].contiguous().view(torch.int64).reshape(tiles, groups, group // 4, 1)
            fifth = (words >> torch.arange(64)) & 1  # [tiles, groups, group/4, 64]
            blocks = blocks | (fifth.reshape(tiles, groups, group // 4, TILE, 4).to(torch.int32) << 4)
    zero = weight.zero - (128 if weight.bits == 8 else 0)
    if within is not None:
        picked = torch.arange(tiles)
        values = blocks[picked, :, :, within].reshape(tiles, width) - (128 if weight.bits == 8 else 0)  # [tiles, in]
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[picked, :, within].contiguous()  # [tiles, groups]
        return QuantizedTensor(torch.from_numpy(pack(values.numpy(), weight.bits)), pick(weight.scale),
                               pick(weight.mins), group, weight.bits, zero, weight.source, ROWS)
    values = blocks.permute(0, 3, 1, 2, 4).reshape(out, width) - (128 if weight.bits == 8 else 0)  # [out, in]
    def transpose(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.transpose(1, 2).reshape(out, groups).contiguous()
    return QuantizedTensor(torch.from_numpy(pack(values.numpy(), weight.bits)), transpose(weight.scale),
                           transpose(weight.mins), group, weight.bits, zero, weight.source, ROWS)
