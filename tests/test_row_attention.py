"""The row-exact attention (tandem/quant/row_attention.cpp, target_service.ragged's row-by-row path)
against plain attention, and a verification pass's rows against one-token steps, bit for bit."""

from __future__ import annotations

import weakref

import pytest
import torch

from tandem.quant import native as quant_native
from tandem.quant.modules import int8_kernel_isa
from tandem.quant.native import load_row_attention, probe, runs_here
from target_service import ragged
from test_quant_model import quantized_gemma  # noqa: F401 (a fixture)

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not runs_here(isa), reason=f"this CPU lacks {isa}"))
        for isa in ("avx2", "avx512")]


@pytest.fixture(params=ISAS)
def native(request):
    return load_row_attention(request.param)


def _plain(query, keys, values, index, scale):
    """One row, plain float64 attention: query [heads, dim], keys/values [kv_heads, T, dim]."""
    heads, kv_heads = query.shape[0], keys.shape[0]
    k = keys[:, index].repeat_interleave(heads // kv_heads, dim=0).double()  # [heads, n, dim]
    v = values[:, index].repeat_interleave(heads // kv_heads, dim=0).double()
    weights = torch.softmax((k @ query.double()[:, :, None])[..., 0] * scale, dim=-1)  # [heads, n]
    return (weights[:, None] @ v)[:, 0].float()  # [heads, dim]


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_each_row_attends_over_its_range_then_its_extra_keys(native, kv_heads) -> None:
    generator = torch.Generator().manual_seed(kv_heads)
    heads, dim, positions = 4, 32, 40
    query = torch.randn(4, heads, dim, generator=generator)
    keys = torch.randn(kv_heads, positions, dim, generator=generator) * 3
    values = torch.randn(kv_heads, positions, dim, generator=generator)
    lo, hi = torch.tensor([0, 5, 0, 30]), torch.tensor([33, 34, 30, 30])
    extra = torch.tensor([[0, 0], [0, 0], [31, 33], [32, 0]])
    count = torch.tensor([0, 0, 2, 1])
    out = native(query, keys, values, lo, hi, extra, count, dim**-0.5, 0.0)
    for row in range(4):
        index = torch.cat([torch.arange(int(lo[row]), int(hi[row])), extra[row, : int(count[row])]])
        torch.testing.assert_close(out[row], _plain(query[row], keys, values, index, dim**-0.5), rtol=1e-5, atol=1e-5)
    # the same keys as views of a longer cache buffer (kv heads apart by its capacity): read in place, same bits
    buffer_keys = torch.zeros(2, kv_heads, positions + 24, dim)  # [batch, kv_heads, capacity, dim]
    buffer_values = torch.zeros_like(buffer_keys)
    buffer_keys[0, :, :positions], buffer_values[0, :, :positions] = keys, values
    views = buffer_keys[0, :, :positions], buffer_values[0, :, :positions]
    assert kv_heads == 1 or not views[0].is_contiguous()
    assert torch.equal(native(query, *views, lo, hi, extra, count, dim**-0.5, 0.0), out)


def test_bad_ranges_are_refused(native) -> None:
    q, k = torch.randn(1, 2, 16), torch.randn(1, 8, 16)
    with pytest.raises(RuntimeError, match="bad key range"):
        native(q, k, k, torch.tensor([0]), torch.tensor([9]), torch.zeros(1, 1, dtype=torch.long),
               torch.tensor([0]), 1.0, 0.0)
    with pytest.raises(RuntimeError, match="no keys"):
        native(q, k, k, torch.tensor([3]), torch.tensor([3]), torch.zeros(1, 1, dtype=torch.long),
               torch.tensor([0]), 1.0, 0.0)


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "pytorch"])
@pytest.mark.parametrize("tree", [None, (-1, 0, -1, 2, 1)], ids=["chain", "tree"])
def test_a_passes_rows_equal_one_token_steps_bit_for_bit(use_native, tree) -> None:
    """Row i of a pass over a cache of 10 keys equals the step at its position over the cache plus
    its path (each path's keys laid out as a committed sequence would be), window 6."""
    native = ragged._native_attention(probe()[0]) if use_native else None
    generator = torch.Generator().manual_seed(3)
    size, cached, heads, dim = 5, 10, 4, 32
    query = torch.randn(1, heads, size, dim, generator=generator)
    keys = torch.randn(1, 1, cached + size, dim, generator=generator)
    values = torch.randn(1, 1, cached + size, dim, generator=generator)
    kwargs = {"scaling": dim**-0.5}
    together = ragged._rows_alone(query, keys, values, 6, tree, kwargs, native)  # [1, n, heads, dim]
    paths = ragged._paths(tree, size)
    for row in range(size):
        order = list(range(cached)) + [cached + node for node in paths[row]]  # the committed sequence
        step_keys, step_values = keys[:, :, order].contiguous(), values[:, :, order].contiguous()
        alone = ragged._rows_alone(query[:, :, row : row + 1].contiguous(), step_keys, step_values, 6, None, kwargs,
                                   native)
        assert torch.equal(alone[0, 0], together[0, row])


def test_a_pass_attends_with_its_models_kernel_build_whatever_the_probe_says(monkeypatch, quantized_gemma) -> None:
    """The native decoder layer is compiled for the model's int8 kernel, so the Python path's row
    attention must be that build too, not the host's (an AVX-512 host running the avx2int8 kernels
    summed the two in other vector widths); a model without an int8 kernel takes the host's."""
    monkeypatch.setattr(quant_native, "probe", lambda: ("the-hosts-build", "forced by the test"))
    monkeypatch.setattr(ragged, "_ISAS", weakref.WeakKeyDictionary())
    isa = int8_kernel_isa(quantized_gemma.model)  # None for a float32-activation build
    wanted = isa if isa in quant_native.ISA_FLAGS else "the-hosts-build"
    assert ragged._attention_isa(quantized_gemma.model) == wanted
