"""tandem calibrate: the paper's arithmetic, and whole runs on tiny models (CPU, no timing asserts)."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from tiny import make_tiny_model

from tandem.tools import calibrate
from tandem.tools.calibrate import formulas
from tandem.tools.calibrate.compare import compare, conditional_rates_from_runs, leading_matches
from tandem.tools.calibrate.drafts import checkpoint_precision

# ---- formulas --------------------------------------------------------------------------------


def test_expected_tokens_per_round_is_the_papers_equation_1() -> None:
    for alpha in (0.0, 0.3, 0.8, 0.95):
        for k in (1, 4, 7):
            assert formulas.expected_tokens_per_round(alpha, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))
    assert formulas.expected_tokens_per_round(1.0, 5) == 6.0  # the alpha -> 1 limit


def test_per_depth_rates_reduce_to_the_constant_case() -> None:
    assert formulas.expected_tokens_per_round_by_depth([0.7], 5) == pytest.approx(
        formulas.expected_tokens_per_round(0.7, 5))
    assert formulas.expected_tokens_per_round_by_depth([0.9, 0.5], 2) == pytest.approx(1 + 0.9 + 0.45)
    assert formulas.expected_tokens_per_round_by_depth([], 3) == 1.0


def test_best_k_maximises_speedup_and_prefers_small_k_on_ties() -> None:
    def speedups(alpha: float, c: float, max_k: int = 8) -> list[float]:
        return [formulas.expected_speedup(formulas.expected_tokens_per_round(alpha, k), c, k)
                for k in range(1, max_k + 1)]

    assert formulas.best_k(speedups(1.0, 0.0)) == 8  # perfect free draft: the longest block
    # alpha 0.8, c 0.2: K=3 1.845, K=4 0.67232 / 0.36 = 1.8676, K=5 1.8446 (Thm 3.8 by hand)
    assert formulas.best_k(speedups(0.8, 0.2)) == 4
    assert formulas.best_k(speedups(0.5, 0.3)) == 1
    assert formulas.best_k([1.0, 1.0, 1.0]) == 1


def test_greedy_runs_and_conditional_rates_agree() -> None:
    runs = [0, 1, 3, 3, 2]
    rates = conditional_rates_from_runs(runs, 3)
    assert rates == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    for k in (1, 2, 3):
        assert formulas.expected_tokens_per_round_by_depth(rates, k) == pytest.approx(
            formulas.greedy_tokens_per_round(runs, k))


def test_compare_kl_overlap_and_zero_mass() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.0], [0.9, 0.05, 0.05]]))
    same = compare(logp, logp.clone())
    assert same.kl.tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    assert same.overlap.tolist() == pytest.approx([1.0, 1.0])
    logq = torch.log(torch.tensor([[1.0, 0.0, 0.0], [0.05, 0.9, 0.05]]))
    other = compare(logp, logq)
    assert other.overlap.tolist() == pytest.approx([0.5, 0.15])
    assert other.greedy_match.tolist() == [True, False]
    assert other.outside_mass.tolist() == pytest.approx([0.5, 0.0])
    assert other.kl[1].item() == pytest.approx(0.9 * torch.log(torch.tensor(18.0)).item()
                                               + 0.05 * torch.log(torch.tensor(0.05 / 0.9)).item(), rel=1e-4)
    assert leading_matches(torch.tensor([[True, True, False], [False, True, True], [True, True, True]])).tolist() == [
        2, 0, 3]


# ---- whole runs on tiny models -----------------------------------------------------------------


def calibrate_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [("code", "def fibonacci(n):\n    if n < 2:"), ("prose", "The quick brown fox jumps"),
            ("json", '{"name": "tandem", "items": [1, 2')]
    path.write_text("".join(json.dumps({"domain": d, "prompt": p}) + "\n" for d, p in rows))
    return path


def run(tmp_path, target, draft, prompts_file, *extra: str) -> dict:
    out = tmp_path / "calibrate.json"
    status = calibrate.main(calibrate_args(
        "--target-model", str(target), "--draft-model", str(draft), "--prompts", str(prompts_file),
        "--max-tokens", "12", "--max-k", "6", "--timing-steps", "2", "--device", "cpu", "--no-progress",
        "--json", str(out), *extra,
    ))
    assert status == 0
    return json.loads(out.read_text())


def test_identical_draft_accepts_everything_and_takes_the_longest_k(tiny_dir, prompts_file, tmp_path, capsys) -> None:
    data = run(tmp_path, tiny_dir, tiny_dir, prompts_file, "--cost-ratio", "0.01")
    assert data["kl_mean"] == pytest.approx(0.0, abs=1e-4)
    assert data["acceptance_rate"] == pytest.approx(1.0, abs=1e-4) and data["greedy_acceptance"] == 1.0
    assert data["recommended_k"] == 6 and data["recommended_k_greedy"] == 6
    assert data["by_k"][-1]["expected_tokens_per_round"] == pytest.approx(7.0, abs=1e-3)
    assert data["cost_ratio"] == 0.01 and data["cost_ratio_source"] == "--cost-ratio"
    assert data["by_k"][0]["verify_cost"] is None and data["recommended_k_measured_verify"] is None
    assert data["positions"] == 36 and set(data["by_domain"]) == {"code", "prose", "json"}
    assert data["warnings"] == [] and data["draft_kind"] == "hf"
    assert "Leviathan" in data["formula"]
    out = capsys.readouterr()
    assert "recommended K = 6" in out.out and "warning" not in out.err


def test_a_random_draft_is_accepted_less(tiny_dir, tiny_draft_dir, prompts_file, tmp_path) -> None:
    data = run(tmp_path, tiny_dir, tiny_draft_dir, prompts_file)
    assert data["kl_mean"] > 0.05
    assert data["acceptance_rate"] < 0.9 and data["greedy_acceptance"] < 0.5
    assert data["target_step_ms"] > 0 and data["draft_step_ms"] > 0 and data["cost_ratio"] > 0
    assert data["cost_ratio_source"].startswith("measured")
    assert 1 <= data["recommended_k"] <= 6 and len(data["by_k"]) == 6
    # the target's forward over K + 1 tokens, relative to one decode step, measured for every K
    assert all(row["verify_cost"] > 0 and row["expected_speedup_measured"] > 0 for row in data["by_k"])
    assert 1 <= data["recommended_k_measured_verify"] <= 6
    if max(row["expected_speedup"] for row in data["by_k"]) < 1:
        assert any(w.startswith("no K pays") for w in data["warnings"])


def test_ngram_is_a_match_rate_only(tiny_dir, prompts_file, tmp_path) -> None:
    data = run(tmp_path, tiny_dir, "ngram", prompts_file)
    assert data["draft_kind"] == "ngram" and data["kl_mean"] is None and data["acceptance_rate"] is None
    assert "not a distribution" in data["draft_description"]
    assert 0.0 <= data["greedy_acceptance"] <= 1.0
    for row in data["by_k"]:
        assert row["expected_tokens_per_round"] == pytest.approx(row["greedy_tokens_per_round"])


def make_head(tiny_dir, folder, target_precision: str | None = None):
    from tandem.models.eagle import EagleConfig, EagleHead, save_head
    from tandem.models import load_tokenizer, tokenizer_fingerprint

    tokenizer = load_tokenizer(str(tiny_dir))
    config = EagleConfig(hidden_size=32, inner_size=64, num_layers=1, reduced_vocab_size=200,
                         target_vocab_size=len(tokenizer), target_model=str(tiny_dir),
                         target_fingerprint=tokenizer_fingerprint(tokenizer), head_tensor="lm_head.weight",
                         metadata={"target_precision": target_precision} if target_precision else {})
    torch.manual_seed(0)
    save_head(folder, EagleHead(config), torch.arange(200))
    return folder


def test_random_eagle_head_per_depth(tiny_dir, prompts_file, tmp_path, capsys) -> None:
    head = make_head(tiny_dir, tmp_path / "head", target_precision="GGUF q4_k_m (quantised)")
    data = run(tmp_path, tiny_dir, head, prompts_file)
    assert data["draft_kind"] == "eagle" and len(data["acceptance_by_depth"]) == 6
    assert data["acceptance_rate"] < 0.9 and 0.0 < data["p_mass_outside_draft_vocab"] < 1.0
    assert data["acceptance_by_depth"][0] == pytest.approx(data["acceptance_rate"])
    warnings = " ".join(data["warnings"])
    assert "precisions differ" in warnings  # head trained on a quantised target, this one is float32
    assert "KL(p||q)" in warnings and "tandem distill" in warnings
    assert "warning: KL(p||q)" in capsys.readouterr().err
    # the eagle: prefix names a head directory too; a head trained on this very target has its precision
    plain = make_head(tiny_dir, tmp_path / "plain-head")
    data = run(tmp_path, tiny_dir, f"eagle:{plain}", prompts_file, "--cost-ratio", "0")
    assert data["draft_kind"] == "eagle" and data["draft_precision"] == "float32"
    assert not any("precisions differ" in w for w in data["warnings"])


def test_quantised_target_and_16_bit_draft_warn(tiny_dir, tiny_draft_dir, prompts_file, tmp_path) -> None:
    target = tmp_path / "gguf-target"
    shutil.copytree(tiny_dir, target)
    (target / ".complete").write_text(json.dumps({"source": "/models/tiny-Q4_K_M.gguf"}))
    draft = tmp_path / "bf16-draft"
    shutil.copytree(tiny_draft_dir, draft)
    config = json.loads((draft / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (draft / "config.json").write_text(json.dumps(config))
    assert checkpoint_precision(target).label == "GGUF q4_k_m (quantised)" and checkpoint_precision(target).quantised
    assert checkpoint_precision(draft).label == "bfloat16"
    data = run(tmp_path, target, draft, prompts_file, "--cost-ratio", "0.1")
    assert data["target_precision"] == "GGUF q4_k_m (quantised)" and data["draft_precision"] == "bfloat16"
    assert any("precisions differ: target GGUF q4_k_m (quantised), draft bfloat16" in w for w in data["warnings"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--max-k", "0"), "--max-k must be in 1..64"),
        (("--num-prompts", "-1"), "--num-prompts must be >= 0"),
        (("--cost-ratio", "-0.5"), "--cost-ratio must be >= 0"),
        (("--max-tokens", "1"), "--max-tokens must be >= 2"),
        (("--prompts", "/nonexistent.jsonl"), "cannot read the prompt file"),
    ],
)
def test_bad_arguments_are_refused(tiny_dir, argv, message) -> None:
    with pytest.raises(SystemExit, match=message):
        calibrate.main(calibrate_args("--target-model", str(tiny_dir), "--draft-model", "ngram", *argv))


def test_bad_models_are_refused(tiny_dir, prompts_file, tmp_path) -> None:
    def fails(draft: str, message: str, target: str = str(tiny_dir)) -> None:
        with pytest.raises(SystemExit, match=message):
            calibrate.main(calibrate_args("--target-model", target, "--draft-model", draft,
                                          "--prompts", str(prompts_file), "--num-prompts", "1", "--no-progress"))

    fails(str(tmp_path / "missing"), "--draft-model: model spec")
    fails("eagle", "no eagle head is shipped for target")
    fails(f"eagle:{tmp_path}", "is not an eagle head directory")
    fails("ngram", "--target-model: model spec", target=str(tmp_path / "missing"))
    other = make_tiny_model(tmp_path / "other", seed=3, tokenizer_vocab_size=280)
    fails(str(other), "do not share a tokenizer")


def test_draft_model_is_required() -> None:
    with pytest.raises(SystemExit):
        calibrate_args("--target-model", "x")
