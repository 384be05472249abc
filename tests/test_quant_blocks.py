"""GGUF block types as integers and group scales (tandem.quant.gguf_blocks, tandem.quant.tensor)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tandem.quant.gguf_blocks import READERS, to_quantized
from tandem.quant.reference import dequantize
from tandem.quant.tensor import (
    ROWS,
    TILES,
    QuantizedTensor,
    from_tiles,
    pack,
    row_bytes,
    to_tiles,
    unpack,
    unsigned_bytes,
)
from tiny import _random_k_blocks

NUMPY_QUANTIZED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf-py quantizes these itself
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_pack_and_unpack_are_inverse(bits: int) -> None:
    rng = np.random.default_rng(bits)
    low, high = (-128, 128) if bits == 8 else (0, 2**bits)
    values = rng.integers(low, high, (7, 96))
    packed = pack(values, bits)
    assert packed.shape == (7, row_bytes(96, bits)) and packed.dtype == np.uint8
    assert torch.equal(unpack(torch.from_numpy(packed), bits, 96), torch.from_numpy(values).to(torch.int32))


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_the_tiles_bytes_are_the_integers_unsigned(bits: int) -> None:
    """What ``to_tiles`` lays out: each integer as an unsigned byte, 8-bit ones plus 128 (every value
    of each width, in every position of a group)."""
    rng = np.random.default_rng(10 + bits)
    low, high = (-128, 128) if bits == 8 else (0, 2**bits)
    values = rng.integers(low, high, (16, 256))
    values[0, : high - low] = np.arange(low, high)
    weight = QuantizedTensor(torch.from_numpy(pack(values, bits)), torch.ones(16, 8), None, 32, bits, 0, "check")
    got = unsigned_bytes(weight)
    assert got.dtype == torch.uint8
    assert torch.equal(got.to(torch.int32), torch.from_numpy(values).to(torch.int32) + (128 if bits == 8 else 0))


@pytest.mark.parametrize("type_name", NUMPY_QUANTIZED + K_TYPES)
def test_blocks_dequantize_to_gguf_values_bit_for_bit(type_name: str) -> None:
    """The repacked integers and scales give gguf-py's own float32 dequantization exactly."""
    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[type_name]
    rows, width = 6, 512
    if type_name in K_TYPES:
        raw = _random_k_blocks(rng, rows, width, type_name)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((rows, width)).astype(np.float32), qtype)
    weight = to_quantized(raw, type_name, (rows, width), check=True)
    expected = gguf.quants.dequantize(raw, qtype).reshape(rows, width)
    assert torch.equal(dequantize(weight), torch.from_numpy(np.ascontiguousarray(expected)))
    assert weight.shape == (rows, width) and weight.source == type_name
    # Bytes a product reads: about the block type's own (Q6_K is read as a byte per weight, 1.5x).
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    assert weight.nbytes <= rows * width // elems * nbytes * (1.55 if type_name == "Q6_K" else 1.35)


def test_every_reader_is_tested() -> None:
    assert sorted(READERS) == sorted(NUMPY_QUANTIZED + K_TYPES)


def test_a_tensor_of_the_wrong_size_is_refused() -> None:
    raw = gguf.quants.quantize(np.ones((2, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="does not hold"):
        to_quantized(raw, "Q8_0", (3, 64))


def test_rows_select_output_rows() -> None:
    raw = gguf.quants.quantize(np.arange(4 * 64, dtype=np.float32).reshape(4, 64) / 100, gguf.GGMLQuantizationType.Q5_1)
    weight = to_quantized(raw, "Q5_1", (4, 64))
    index = torch.tensor([3, 1])
    assert torch.equal(dequantize(weight.rows(index)), dequantize(weight)[index])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_1", "Q8_0", "Q4_K"])
def test_rows_of_a_tiled_tensor_are_its_rows(type_name: str) -> None:
    # The int8 kernel's 16-row tiles (a tied head is also the embedding): a lookup unpacks only
    # the rows it asks for, in any order and with repeats.
    qtype = gguf.GGMLQuantizationType[type_name]
    rows, width = 48, 512
    if type_name in K_TYPES:
        raw = _random_k_blocks(np.random.default_rng(1), rows, width, type_name)
    else:
        raw = gguf.quants.quantize(np.random.default_rng(1).standard_normal((rows, width)).astype(np.float32), qtype)
    weight = to_quantized(raw, type_name, (rows, width))
    tiled = to_tiles(weight)
    assert tiled.layout == TILES
    index = torch.tensor([47, 0, 17, 17, 31, 16])
    picked = tiled.rows(index)
    assert picked.layout == ROWS and picked.shape == (len(index), width)
    assert torch.equal(dequantize(picked), dequantize(weight)[index])
    assert torch.equal(dequantize(from_tiles(tiled)), dequantize(weight))
