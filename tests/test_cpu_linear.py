"""The CPU linears (oneDNN-packed weights, or the weights-stationary few-row product without them)
compute what F.linear computes, and only where they should."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.cpu import linear as cpu_linear
from tandem.cpu.linear import K_SLICE, MAX_ROWS, few_row_linear, install_cpu_linears, pack_weight, packed_linear, split_inner


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 9, MAX_ROWS, MAX_ROWS + 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 48, generator=gen)  # [out, in]
    b = torch.randn(300, generator=gen) if bias else None  # [out]
    x = torch.randn(1, rows, 48, generator=gen)  # [batch, rows, in]
    got = few_row_linear(x, weight, b)  # [1, rows, out]
    assert got.shape == (1, rows, 300)
    assert got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 9])
def test_products_over_inner_slices_match_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(40, 2 * K_SLICE + 100, generator=gen)  # [out, in]: three slices, the last short
    b = torch.randn(40, generator=gen)
    slices = split_inner(weight)
    assert [piece.shape for piece in slices] == [(40, K_SLICE), (40, K_SLICE), (40, 100)]
    assert all(piece.is_contiguous() for piece in slices)
    x = torch.randn(rows, weight.shape[1], generator=gen)  # [rows, in]
    torch.testing.assert_close(few_row_linear(x, weight, b, slices), F.linear(x, weight, b), rtol=1e-4, atol=1e-3)


@pytest.fixture
def no_packing(monkeypatch):
    """A torch whose packed product fails (as where oneDNN is missing): the few-row path serves."""

    def unavailable(*args, **kwargs):
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr(cpu_linear, "packed_linear", unavailable)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 48, generator=gen)  # [out, in]
    b = torch.randn(300, generator=gen) if bias else None  # [out]
    packed = pack_weight(weight)
    assert packed is not None
    x = torch.randn(1, rows, 48, generator=gen)  # [batch, rows, in]
    got = packed_linear(x, packed, b)  # [1, rows, out]
    assert got.shape == (1, rows, 300)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    strided = torch.randn(48, rows, generator=gen).T  # [rows, in], not contiguous
    torch.testing.assert_close(packed_linear(strided, packed, b), F.linear(strided, weight, b), rtol=1e-5, atol=1e-4)


def test_installed_layers_compute_through_the_packed_copy_in_inference_only() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 3))
    x = torch.randn(2, 5, 8)  # [batch, rows, in]
    with torch.inference_mode():
        expected = model(x)
    assert install_cpu_linears(model, "cpu") == 2
    assert all(layer.packed_weight.get(layer.weight) is not None for layer in (model[0], model[2]))
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x[0, 0]), expected[0, 0], rtol=1e-5, atol=1e-5)  # a vector
        assert model(x[:, :0]).shape == (2, 0, 3)  # no rows
    # A weight changed after install is packed again before it is used.
    with torch.no_grad():
        model[2].weight.zero_()
    with torch.inference_mode():
        assert torch.equal(model(x), model[2].bias.expand(2, 5, 3))


def test_a_copied_or_converted_model_computes_with_its_own_weights() -> None:
    import copy

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 3))
    install_cpu_linears(model, "cpu")
    x = torch.randn(4, 8)
    twin = copy.deepcopy(model)  # oneDNN's opaque tensors cannot be copied: the twin packs its own
    with torch.no_grad():
        twin[0].weight.mul_(2.0)
    with torch.inference_mode():
        torch.testing.assert_close(twin[0](x), F.linear(x, twin[0].weight, twin[0].bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)
        low = twin.to(torch.bfloat16)
        reference = F.linear(F.silu(F.linear(x.bfloat16(), low[0].weight, low[0].bias)), low[2].weight, low[2].bias)
        torch.testing.assert_close(low(x.bfloat16()), reference, rtol=2e-2, atol=2e-2)


def test_a_packed_copy_that_disagrees_is_not_used(monkeypatch) -> None:
    monkeypatch.setattr(cpu_linear, "packed_linear", lambda x, packed, bias=None: torch.zeros(x.shape[0], 4))
    assert pack_weight(torch.randn(4, 6)) is None


def test_without_packing_the_few_row_product_serves(no_packing) -> None:
    layer = torch.nn.Linear(6, 10)
    assert install_cpu_linears(layer, "cpu") == 1
    assert layer.packed_weight.get(layer.weight) is None
    x = torch.randn(3, 6)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_long_inner_weights_get_split_copies_within_the_budget(monkeypatch, no_packing) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2 * K_SLICE, 8), torch.nn.Linear(8, 2 * K_SLICE),
                                torch.nn.Linear(2 * K_SLICE, 8))
    one = 8 * 2 * K_SLICE * 4  # bytes of one [8, 2048] float32 weight
    monkeypatch.setattr(cpu_linear, "MAX_SPLIT_BYTES", one)
    assert install_cpu_linears(model, "cpu") == 3
    assert len(model[0].few_row_slices) == 2  # split
    assert not hasattr(model[1], "few_row_slices")  # a short inner dimension needs none
    assert not hasattr(model[2], "few_row_slices")  # over the budget
    x = torch.randn(4, 2 * K_SLICE)
    with torch.inference_mode():
        torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6])
def test_a_strided_result_holds_the_same_values(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, b = torch.randn(300, 48, generator=gen), torch.randn(300, generator=gen)
    x = torch.randn(1, rows, 48, generator=gen)  # [batch, rows, in]
    got = few_row_linear(x, weight, contiguous=False)  # [1, rows, out]
    assert got.shape == (1, rows, 300)
    assert got.is_contiguous() == (rows > 4)  # one chunk comes back as the product's transposed view
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert torch.equal(got, few_row_linear(x, weight))
    torch.testing.assert_close(few_row_linear(x, weight, b, contiguous=False), F.linear(x, weight, b),
                               rtol=1e-5, atol=1e-4)


def test_keeps_leading_dimensions_and_handles_a_vector() -> None:
    weight = torch.randn(10, 6)
    x = torch.randn(2, 3, 6)  # [a, b, in]: 6 rows in all
    torch.testing.assert_close(few_row_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    v = torch.randn(6)  # [in]
    assert few_row_linear(v, weight).shape == (10,)
    torch.testing.assert_close(few_row_linear(v, weight), F.linear(v, weight), rtol=1e-5, atol=1e-5)


def test_empty_input() -> None:
    assert few_row_linear(torch.zeros(1, 0, 6), torch.randn(10, 6)).shape == (1, 0, 10)


def test_gradients_still_flow_in_training() -> None:
    layer = torch.nn.Linear(6, 4)
    install_cpu_linears(layer, "cpu")
    x = torch.randn(3, 6, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and x.grad is not None
    torch.testing.assert_close(x.grad, layer.weight.sum(dim=0).expand(3, 6).detach())


def test_installs_on_float32_cpu_linears_only() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x = torch.randn(2, 8)
    with torch.inference_mode():
        expected = model(x)
    assert install_cpu_linears(model, "cpu") == 2
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)

    assert install_cpu_linears(torch.nn.Linear(4, 4), "cuda") == 0
    assert install_cpu_linears(torch.nn.Linear(4, 4).to(torch.bfloat16), "cpu") == 0


def test_installed_by_the_model_loader(tiny_dir) -> None:
    from tandem.models import load_model

    loaded = load_model(str(tiny_dir), device="cpu", dtype="float32")
    head = loaded.model.get_output_embeddings()
    assert "forward" in vars(head)  # the instance's own forward, not nn.Linear's
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.packed_weight.get(m.weight) is not None for m in linears)


def test_without_packing_the_loader_keeps_the_head_logits_a_strided_view(tiny_dir, no_packing) -> None:
    from tandem.models import load_model

    loaded = load_model(str(tiny_dir), device="cpu", dtype="float32")
    head = loaded.model.get_output_embeddings()
    assert head.packed_weight.get(head.weight) is None and head.few_row_contiguous is False
    assert all(m.few_row_contiguous for m in loaded.model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
