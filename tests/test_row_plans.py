"""One- and two-row calls of packed linears take the product timed fastest on this host
(``tandem.cpu.row_plans``), and every product computes what F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.cpu import linear as cpu_linear
from tandem.cpu.linear import FEW, PAD, install_cpu_linears
from tandem.cpu.row_plans import MARGIN, PACKED, tune_row_plans, tune_screen_rows
from tandem.cpu.screened_head import ScreenedArgmax


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
        ("layers", PACKED, 1): 1.0, ("layers", PAD, 1): MARGIN + 0.01,
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


def test_a_noisy_sweep_does_not_decide(model: TinyLM) -> None:
    """Medians over the sweeps: one sweep where padding looked twice as fast (the host quiet just
    then) does not make it the plan, nor one where the packed product looked slow."""
    calls: dict[tuple[str, int], int] = {}

    def measure(layers, plan, rows):
        calls[(plan, rows)] = calls.get((plan, rows), 0) + 1
        if list(layers) == [model.lm_head]:
            return 1.0
        if rows == 2 and plan == PAD and calls[(plan, rows)] == 3:
            return 0.5  # one lucky sweep
        if rows == 1 and plan == PACKED and calls[(plan, rows)] == 4:
            return 5.0  # one busy sweep
        return 1.0

    assert tune_row_plans(model, measure, min_bytes=0) == {}


def test_the_screen_is_padded_where_its_padded_product_is_clearly_faster(bf16_screen_packs) -> None:
    screen = ScreenedArgmax(torch.randn(1000, 48))
    costs = {(PACKED, 1): 1.0, (PAD, 1): MARGIN + 0.02, (PACKED, 2): 1.2, (PAD, 2): 0.8}
    assert tune_screen_rows(screen, TinyLM(), lambda plan, rows: costs[(plan, rows)]) == {2: PAD}
    assert screen.row_plan == {2: PAD}


def test_a_padded_screen_gives_the_same_tokens(model: TinyLM, monkeypatch, bf16_screen_packs) -> None:
    """Real timings on this host (whatever wins), then both products: the same exact argmax."""
    weight = torch.randn(3000, 48, generator=torch.Generator().manual_seed(5))  # [vocab, hidden]
    screen = ScreenedArgmax(weight)
    chosen = tune_screen_rows(screen, model)
    assert set(chosen) <= {1, 2} and set(chosen.values()) <= {PAD}
    calls = []
    import tandem.cpu.screened_head

    original = tandem.cpu.screened_head.padded_linear  # oneDNN's, or the stand-in where this host cannot pack
    monkeypatch.setattr("tandem.cpu.screened_head.padded_linear", lambda *a: calls.append(1) or original(*a))
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(6))  # [rows, hidden]
    for rows in (1, 2):
        screen.row_plan = {}
        plain = screen(x[:rows])
        screen.row_plan = {rows: PAD}
        assert torch.equal(screen(x[:rows]), plain)
        assert torch.equal(plain, (x[:rows].double() @ weight.double().T).argmax(dim=1))
    assert len(calls) == 2


def test_slow_sweeps_stop_at_the_minimum(model: TinyLM, monkeypatch, bf16_screen_packs) -> None:
    """A model whose sweeps take long (each streams gigabytes) gets MIN_SWEEPS of them, not SWEEPS."""
    from tandem.cpu import row_plans

    monkeypatch.setattr(row_plans, "SWEEP_BUDGET_S", 0.0)
    calls: list[tuple[str, int]] = []
    tune_screen_rows(ScreenedArgmax(torch.randn(500, 48)), model, lambda plan, rows: calls.append((plan, rows)) or 1.0)
    assert len(calls) == 2 * 2 * (row_plans.MIN_SWEEPS + 1)  # plans x row counts x (warm-up + minimum)
    monkeypatch.setattr(row_plans, "SWEEP_BUDGET_S", 60.0)
    calls.clear()
    tune_screen_rows(ScreenedArgmax(torch.randn(500, 48)), model, lambda plan, rows: calls.append((plan, rows)) or 1.0)
    assert len(calls) == 2 * 2 * (row_plans.SWEEPS + 1)


def test_an_unpacked_screen_is_not_timed(monkeypatch) -> None:
    """The other side of the probe: where oneDNN cannot pack the bfloat16 copy, no plans."""
    monkeypatch.setattr("tandem.cpu.screened_head.pack_weight", lambda weight: None)
    screen = ScreenedArgmax(torch.randn(500, 48))
    assert not screen.packed
    assert tune_screen_rows(screen, TinyLM(), lambda plan, rows: 1.0) == {} and screen.row_plan == {}
