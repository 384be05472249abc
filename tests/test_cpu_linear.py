"""The weights-stationary few-row linear computes what F.linear computes, and only where it should."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import cpu_linear
from tandem.cpu_linear import K_SLICE, MAX_ROWS, few_row_linear, install_cpu_linears, split_inner


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


def test_long_inner_weights_get_split_copies_within_the_budget(monkeypatch) -> None:
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
    assert head.few_row_contiguous is False
    assert all(m.few_row_contiguous for m in loaded.model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
