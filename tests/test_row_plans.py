"""One- and two-row calls of packed linears take the product timed fastest on this host
(``tandem.row_plans``), and every product computes what F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import cpu_linear
from tandem.cpu_linear import FEW, PAD, install_cpu_linears
from tandem.row_plans import MARGIN, PACKED, tune_row_plans


class TinyLM(torch.nn.Module):
    """Two layers and an output embedding, the shape tune_row_plans looks for."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up = torch.nn.Linear(48, 96)
        self.down = torch.nn.Linear(96, 48, bias=False)
        self.lm_head = torch.nn.Linear(48, 300, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)
            p.copy_(torch.randn(p.shape, generator=gen))

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.down(self.up(x)))


@pytest.fixture
def model() -> TinyLM:
    m = TinyLM()
    assert install_cpu_linears(m, "cpu") == 3
    return m


@pytest.mark.parametrize("plan", [PAD, FEW])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_each_plan_computes_what_f_linear_computes(model: TinyLM, monkeypatch, plan: str, rows: int) -> None:
    calls = []
    wrapped = {PAD: "padded_linear", FEW: "few_row_linear"}[plan]
    original = getattr(cpu_linear, wrapped)
    monkeypatch.setattr(cpu_linear, wrapped, lambda *a, **k: calls.append(1) or original(*a, **k))
    layer = model.lm_head
    layer.row_plan = {rows: plan}
    x = torch.randn(1, rows, 48, generator=torch.Generator().manual_seed(rows))  # [batch, rows, in]
    with torch.inference_mode():
        got = layer(x)  # [1, rows, 300]
        other = layer(torch.randn(1, rows + 1, 48))  # a row count without a plan: the packed product
    assert calls == [1]  # the planned row count took the plan's product, the other did not
    assert got.shape == (1, rows, 300) and other.shape == (1, rows + 1, 300)
    torch.testing.assert_close(got, F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)


def test_the_fastest_product_is_chosen_only_by_a_clear_margin(model: TinyLM) -> None:
    # seconds by (part, plan, rows): padding pays for the layers at two rows only, the few-row
    # product for the head at one row; the head's padded two-row product is within the margin.
    costs = {
        ("layers", PACKED, 1): 1.0, ("layers", PAD, 1): 0.95,
        ("layers", PACKED, 2): 1.0, ("layers", PAD, 2): 0.8,
        ("head", PACKED, 1): 2.0, ("head", PAD, 1): 1.9, ("head", FEW, 1): 1.5,
        ("head", PACKED, 2): 2.0, ("head", PAD, 2): 2.0 * MARGIN + 0.01, ("head", FEW, 2): 3.0,
    }

    def measure(layers, plan, rows):
        part = "head" if list(layers) == [model.lm_head] else "layers"
        assert part == "head" or set(layers) == {model.up, model.down}
        return costs[(part, plan, rows)]

    chosen = tune_row_plans(model, measure, min_bytes=0)
    assert chosen == {"layers": {2: PAD}, "head": {1: FEW}}
    assert model.up.row_plan == model.down.row_plan == {2: PAD}
    assert model.lm_head.row_plan == {1: FEW}


def test_small_models_are_not_timed(model: TinyLM) -> None:
    def measure(*args):
        raise AssertionError("a model under min_bytes was timed")

    assert tune_row_plans(model, measure) == {}
    assert not hasattr(model.up, "row_plan")


def test_timed_plans_keep_the_models_output(model: TinyLM) -> None:
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(7))  # [rows, in]
    with torch.inference_mode():
        before = [model(x[:rows]) for rows in (1, 2)]
    chosen = tune_row_plans(model, min_bytes=0)  # real timings: whatever wins here
    assert set(chosen) <= {"layers", "head"}
    assert all(plan in (PAD, FEW) for plans in chosen.values() for plan in plans.values())
    with torch.inference_mode():
        for rows, expected in zip((1, 2), before):
            torch.testing.assert_close(model(x[:rows]), expected, rtol=1e-5, atol=1e-4)
