"""The screened LM head (``tandem.cpu.screened_head``): exact greedy tokens from a bfloat16 screen."""

from __future__ import annotations

import pytest
import torch

from tandem.models import load_model
from tandem.cpu.screened_head import BLOCK, ScreenedArgmax, screened_argmax_for


def _exact_argmax(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().T).argmax(dim=1)  # [n]


def _weight(vocab: int, hidden: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, hidden, generator=generator) / hidden**0.5  # [vocab, hidden]


@pytest.mark.parametrize("vocab", [BLOCK * 40, BLOCK * 40 + 77, 50])  # whole blocks, a tail, a tail only
def test_the_screen_gives_the_exact_argmax_where_bfloat16_cannot_tell_the_leaders_apart(vocab) -> None:
    """Rows whose two best logits differ by 1e-4 to 1e-2 (far below bfloat16's resolution at
    logits of ~10-100): the screen finds the exact winner every time, at every scale."""
    hidden = 64
    weight = _weight(vocab, hidden)
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i in range(48):
        leader, runner_up = torch.randint(0, vocab, (2,), generator=generator).tolist()
        if leader == runner_up:
            runner_up = (leader + 1) % vocab
        gap = 10.0 ** -(2 + i % 3)  # 1e-2, 1e-3, 1e-4
        # Runner-up and leader share a direction; the leader's row is a hair longer along x.
        x = weight[leader] * (10.0 + 10 * (i % 4))  # [hidden], scaled so the logits reach 10 to 40+
        weight[runner_up] = weight[leader] * (1 - gap / float(x @ weight[leader]))
        rows.append(x)
    x = torch.stack(rows)  # [48, hidden]
    screened = ScreenedArgmax(weight)
    want = _exact_argmax(weight, x)
    assert torch.equal(screened(x), want)
    # bfloat16 alone would get some of these wrong: the test would not tell otherwise.
    rounded = (x.to(torch.bfloat16) @ weight.to(torch.bfloat16).T).float().argmax(dim=1)
    assert not torch.equal(rounded, want)


def test_random_rows_at_many_scales_agree_with_the_exact_argmax() -> None:
    weight = _weight(BLOCK * 64, 96, seed=2)
    screened = ScreenedArgmax(weight)
    generator = torch.Generator().manual_seed(3)
    for scale in (0.01, 1.0, 30.0, 1000.0):
        x = torch.randn(32, 96, generator=generator) * scale  # [32, hidden]
        assert torch.equal(screened(x), _exact_argmax(weight, x)), scale


def test_ties_go_to_the_lowest_index_as_torch_argmax_breaks_them() -> None:
    weight = _weight(BLOCK * 8, 32, seed=4)
    weight[700] = weight[9]
    weight[300] = weight[9]
    x = weight[9:10] * 20  # [1, hidden]: rows 9, 300 and 700 tie exactly
    assert ScreenedArgmax(weight)(x).tolist() == [9]
    assert torch.nn.functional.linear(x, weight).argmax(dim=1).tolist() == [9]


def test_rows_that_are_not_finite_fall_back_to_the_float32_product_and_the_others_still_screen() -> None:
    weight = _weight(BLOCK * 4, 16, seed=5)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(6))  # [4, hidden]
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    got = ScreenedArgmax(weight)(x)
    want = torch.nn.functional.linear(x, weight).argmax(dim=1)
    assert got.tolist() == want.tolist()
    assert got[0] == _exact_argmax(weight, x[:1])[0] and got[3] == _exact_argmax(weight, x[3:])[0]


def test_no_rows_give_no_tokens_and_other_dtypes_are_rounded_to_float32_first() -> None:
    weight = _weight(BLOCK * 2, 8, seed=7)
    screened = ScreenedArgmax(weight)
    assert screened(torch.empty(0, 8)).shape == (0,)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    assert torch.equal(screened(x), _exact_argmax(weight, x.float()))
    with pytest.raises(ValueError, match="float32"):
        ScreenedArgmax(weight.double())


def test_a_model_gets_a_screen_only_where_it_pays_and_is_exact(tiny_gemma_dir, bf16_screen_packs) -> None:
    """A float32 CPU head at or past the size threshold; not a small one, not on CUDA, not with
    final logit soft-capping (tanh can round two logits to one float)."""
    loaded = load_model(str(tiny_gemma_dir), device="cpu", dtype="float32")
    model = loaded.model
    assert screened_argmax_for(model, "cpu") is None  # a tiny head
    screened = screened_argmax_for(model, "cpu", min_bytes=0)
    assert isinstance(screened, ScreenedArgmax)
    assert screened.vocab_size == model.get_output_embeddings().weight.shape[0]
    assert screened_argmax_for(model, "cuda", min_bytes=0) is None
    text_config = model.config.get_text_config()
    before = getattr(text_config, "final_logit_softcapping", None)
    try:
        text_config.final_logit_softcapping = 30.0
        assert screened_argmax_for(model, "cpu", min_bytes=0) is None
    finally:
        text_config.final_logit_softcapping = before


def test_where_onednn_cannot_pack_the_screen_greedy_tokens_read_the_float32_head(tiny_gemma_dir, monkeypatch,
                                                                                    caplog) -> None:
    """The other side of the probe (an AVX2-only host): no screen, and the log says why."""
    import logging

    import tandem.cpu.screened_head

    monkeypatch.setattr(tandem.cpu.screened_head, "pack_weight", lambda weight: None)
    loaded = load_model(str(tiny_gemma_dir), device="cpu", dtype="float32")
    with caplog.at_level(logging.INFO, logger="tandem.cpu.screened_head"):
        assert screened_argmax_for(loaded.model, "cpu", min_bytes=0) is None
    assert "oneDNN cannot pack its bfloat16 copy here" in caplog.text


def test_a_quantized_head_gets_no_screen_and_is_not_dequantized(tiny_gguf_gemma, tmp_path, monkeypatch) -> None:
    """A head on GGUF blocks is no float32 ``nn.Linear``: the check says so before reading its
    ``weight``, which for a quantized module is a float32 copy (for gemma-3-270m 671 MB and two
    seconds of every start)."""
    from transformers import AutoModelForCausalLM

    from tandem.quant.checkpoint import BLOCKS_FILE, quantize_model
    from tandem.quant.modules import QuantLinear
    from tandem.quant.native import QuantKernel

    hf_dir, gguf_path = tiny_gguf_gemma
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    model.config.get_text_config().final_logit_softcapping = None  # so that only the head's type can say no
    quantize_model(model, gguf_path, tmp_path / BLOCKS_FILE, QuantKernel("reference-int8"))
    assert isinstance(model.get_output_embeddings(), QuantLinear)

    def refuse(self):
        raise AssertionError("the quantized head was dequantized")

    monkeypatch.setattr(QuantLinear, "weight", property(refuse))
    assert screened_argmax_for(model, "cpu", min_bytes=0) is None
