"""The weights-stationary few-row linear computes what F.linear computes, and only where it should."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.cpu_linear import MAX_ROWS, few_row_linear, install_cpu_linears


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
