"""The calibration run: target passes, draft scores, step timings, and the report they make."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.tools.bench.prompts import Prompt
from tandem.tools.calibrate import formulas
from tandem.tools.calibrate.compare import Stats, conditional_rates_from_runs
from tandem.tools.calibrate.drafts import (
    CalibrateError,
    Drafter,
    EagleDrafterScorer,
    HFDrafter,
    NgramDrafterScorer,
    Precision,
    TargetPass,
    checkpoint_precision,
    lm_step_seconds,
    lm_verify_seconds,
)

KL_WARN = 0.8
FORMULA = (
    "E[tokens/round] = (1 - a^(K+1)) / (1 - a), E[speedup] = E[tokens/round] / (cK + 1); "
    "Leviathan, Kalman, Matias 2023, 'Fast Inference from Transformers via Speculative Decoding', "
    "Eq. 1 and Thm 3.8 (per-depth a_d: 1 + sum_k prod_{d<=k} a_d)"
)
_SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


@dataclass
class KRow:
    k: int
    expected_tokens_per_round: float
    expected_accepted_length: float
    expected_speedup: float
    greedy_tokens_per_round: float | None
    greedy_speedup: float | None
    # The paper takes a verification of K tokens to cost one target step (true when decoding is
    # memory-bound, as on a GPU at batch 1). On a CPU it costs more; measured, it gives:
    verify_cost: float | None = None  # target forward of K + 1 tokens / one decode step
    expected_speedup_measured: float | None = None  # E[tokens/round] / (cK + verify_cost)


@dataclass
class DomainFigures:
    positions: int
    kl_mean: float | None
    acceptance_rate: float | None
    greedy_acceptance: float | None


@dataclass
class CalibrationReport:
    target_model: str
    draft_model: str
    draft_kind: str
    draft_description: str
    target_precision: str
    draft_precision: str | None
    device: str
    dtype: str
    prompts: int
    positions: int
    max_tokens: int
    max_k: int
    kl_mean: float | None
    acceptance_rate: float | None  # E[sum min(p, q)] at depth 1
    greedy_acceptance: float  # P[argmax q = argmax p] at depth 1
    acceptance_by_depth: list[float]
    recommendation_basis: str
    target_step_ms: float | None
    draft_step_ms: float | None
    cost_ratio: float
    cost_ratio_source: str
    by_k: list[KRow]
    recommended_k: int
    recommended_k_greedy: int | None
    recommended_k_measured_verify: int | None = None
    p_mass_outside_draft_vocab: float | None = None
    by_domain: dict[str, DomainFigures] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    formula: str = FORMULA


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _head_precision(head_dir: Path, config: Any, target: Any) -> Precision:
    """An eagle head borrows the target's own embedding and LM head, so its storage dtype says
    little; what matters is the precision of the target it was trained on: the
    ``target_precision`` its metadata records (a ``checkpoint_precision`` label), else that of the
    checkpoint its ``target_model`` names, when that is this target or a folder here."""
    recorded = config.metadata.get("target_precision")
    if isinstance(recorded, str) and recorded:
        return Precision(recorded, "quantised" in recorded)
    trained_for = str(config.target_model)
    if trained_for in (target.name, str(target.hf_dir)):
        return checkpoint_precision(target.hf_dir)
    if (Path(trained_for) / "config.json").is_file():
        return checkpoint_precision(Path(trained_for))
    from safetensors import safe_open

    with safe_open(str(head_dir / "head.safetensors"), framework="pt") as f:
        name = next((k for k in f.keys() if k != "vocab_ids"), None)  # noqa: SIM118
        raw = f.get_slice(name).get_dtype() if name else "F32"
    return Precision(f"{_SAFETENSORS_DTYPES.get(raw, raw.lower())} head, trained on a target of unrecorded precision",
                     False)


def eagle_head_dir(spec: str, target_name: str) -> Path | None:
    """``eagle`` (the head shipped for a built-in target), ``eagle:DIR`` or a head DIR; None if the
    SPEC names no eagle head."""
    from tandem.models.eagle import builtin_head_dir, is_head_dir

    if spec == "eagle":
        found = builtin_head_dir(target_name)
        if found is None:
            raise CalibrateError(
                f"no eagle head is shipped for target {target_name!r}; train one with `tandem distill` "
                "and pass its directory as --draft-model"
            )
        return found
    path = Path(spec.removeprefix("eagle:")).expanduser()
    if spec.startswith("eagle:") and not is_head_dir(path):
        raise CalibrateError(f"{path} is not an eagle head directory (no eagle.json)")
    return path if is_head_dir(path) else None


def load_drafter(spec: str, target: Any) -> Drafter:
    """The scorer for a draft SPEC, checked against the loaded target (tokenizer, vocabulary)."""
    from tandem import models

    spec = models.resolve_draft_spec(spec, target.name)
    if models.ngram_first_head(spec) is not None:
        raise CalibrateError(
            f"{spec!r} pairs two drafters, and calibrate scores one at a time: run it with --draft-model ngram "
            f"and with --draft-model {spec.removeprefix(models.NGRAM_FIRST_PREFIX)}; "
            f"`tandem bench --start-stack --draft-model {spec}` measures the pair"
        )
    if spec in models.MODEL_FREE_DRAFTS:
        return NgramDrafterScorer()
    head_dir = eagle_head_dir(spec, target.name)
    fingerprint = models.tokenizer_fingerprint(target.tokenizer)
    if head_dir is not None:
        from tandem.models.eagle import EagleCheckpointError, EagleDrafter, load_head, load_target_tensors

        try:
            head, vocab_ids = load_head(head_dir)
            if head.config.target_fingerprint != fingerprint:
                raise CalibrateError(
                    f"the eagle head {head_dir} was trained for {head.config.target_model!r}, whose tokenizer "
                    f"differs from the target {target.name!r}'s; pick the head made for this target"
                )
            tensors = load_target_tensors(target.hf_dir, head.config, vocab_ids)
        except EagleCheckpointError as exc:
            raise CalibrateError(str(exc)) from exc
        # Scored as the draft service runs it: bf16 steps over its most frequent --eagle-vocab tokens.
        from tandem.config import DraftSettings

        served_vocab = DraftSettings.model_fields["eagle_vocab"].default
        drafter = EagleDrafter(head, vocab_ids, tensors, dtype=torch.bfloat16, vocab_limit=served_vocab)
        return EagleDrafterScorer(drafter, head_dir, _head_precision(head_dir, head.config, target))
    try:
        draft = models.load_model(spec, device=target.device, dtype=target.dtype)
    except models.ModelSpecError as exc:
        raise CalibrateError(f"--draft-model: {exc} (or 'ngram', 'eagle', an eagle head directory)") from exc
    if models.tokenizer_fingerprint(draft.tokenizer) != fingerprint:
        raise CalibrateError(
            f"draft {spec!r} and target {target.name!r} do not share a tokenizer; tandem refuses such a "
            "pair, so there is nothing to calibrate"
        )
    return HFDrafter(draft, spec, checkpoint_precision(draft.hf_dir))


def target_pass(target: Any, prompt: str, max_tokens: int, need_hidden: bool) -> TargetPass:
    """The target's greedy continuation of ``prompt``, then one teacher-forced pass over it all."""
    tokenizer = target.tokenizer
    encoded = tokenizer(prompt, return_tensors="pt", add_special_tokens=True).to(target.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        seq = target.model.generate(
            **encoded, max_new_tokens=max_tokens, do_sample=False, top_k=None, top_p=None, temperature=None,
            pad_token_id=pad,
        )[0]
        out = target.model(input_ids=seq[None], output_hidden_states=need_hidden)
    hidden = out.hidden_states[-1][0].float().cpu() if need_hidden else None
    return TargetPass(seq.cpu(), int(encoded["input_ids"].shape[1]), out.logits[0].float().cpu(), hidden)


def _figures(stats: Stats) -> DomainFigures:
    return DomainFigures(
        positions=stats.positions,
        kl_mean=_mean(stats.kl),
        acceptance_rate=_mean(stats.overlap_by_depth[0]) if stats.overlap_by_depth[0] else None,
        greedy_acceptance=_mean([float(m) for m in stats.greedy_match]),
    )


def build_report(
    target_spec: str, draft_spec: str, target: Any, drafter: Drafter, stats: Stats, by_domain: dict[str, Stats],
    prompts: int, max_tokens: int, max_k: int, cost: tuple[float | None, float | None, float, str],
    verify_costs: Sequence[float] | None = None,
) -> CalibrationReport:
    target_ms, draft_ms, c, source = cost
    if drafter.kind == "ngram":
        alphas = conditional_rates_from_runs(stats.runs, max_k)
        basis = "greedy match runs of prompt lookup (no distribution)"
    elif drafter.kind == "eagle":
        alphas = stats.alphas_by_depth()
        basis = "acceptance per depth (the head rolls its own features forward)"
    else:
        alphas = stats.alphas_by_depth()[:1]
        basis = "alpha = E[sum min(p, q)] (Leviathan et al. 2023)"
    rows = []
    for k in range(1, max_k + 1):
        tokens = formulas.expected_tokens_per_round_by_depth(alphas, k)
        greedy = formulas.greedy_tokens_per_round(stats.runs, k) if stats.runs else None
        verify = verify_costs[k - 1] if verify_costs else None
        rows.append(KRow(
            k, tokens, tokens - 1.0, formulas.expected_speedup(tokens, c, k), greedy,
            formulas.expected_speedup(greedy, c, k) if greedy is not None else None,
            verify, tokens / (c * k + verify) if verify else None,
        ))
    greedy_speedups = [r.greedy_speedup for r in rows if r.greedy_speedup is not None]
    figures = _figures(stats)
    target_precision = checkpoint_precision(target.hf_dir)
    report = CalibrationReport(
        target_model=target_spec,
        draft_model=draft_spec,
        draft_kind=drafter.kind,
        draft_description=drafter.description,
        target_precision=target_precision.label,
        draft_precision=drafter.precision.label if drafter.precision else None,
        device=target.device,
        dtype=target.dtype,
        prompts=prompts,
        positions=stats.positions,
        max_tokens=max_tokens,
        max_k=max_k,
        kl_mean=figures.kl_mean,
        acceptance_rate=figures.acceptance_rate,
        greedy_acceptance=figures.greedy_acceptance or 0.0,
        acceptance_by_depth=alphas,
        recommendation_basis=basis,
        target_step_ms=target_ms,
        draft_step_ms=draft_ms,
        cost_ratio=c,
        cost_ratio_source=source,
        by_k=rows,
        recommended_k=formulas.best_k([r.expected_speedup for r in rows]),
        recommended_k_greedy=formulas.best_k(greedy_speedups) if len(greedy_speedups) == max_k else None,
        recommended_k_measured_verify=(
            formulas.best_k([r.expected_speedup_measured for r in rows]) if verify_costs else None  # type: ignore[misc]
        ),
        p_mass_outside_draft_vocab=_mean(stats.outside_mass) if drafter.kind == "eagle" else None,
        by_domain={d: _figures(s) for d, s in sorted(by_domain.items())},
    )
    report.warnings = warnings_for(report, target_precision, drafter.precision)
    return report


def warnings_for(report: CalibrationReport, target: Precision, draft: Precision | None) -> list[str]:
    found = []
    comparable = draft is not None and "unrecorded" not in draft.label
    if comparable and draft is not None and (draft.label != target.label or draft.quantised != target.quantised):
        found.append(
            f"precisions differ: target {target.label}, draft {draft.label}. The agreement measured here holds for "
            "this pair only; a draft made against a 16-bit target agrees less with a quantised one (and the "
            "reverse): distill against the target you serve"
        )
    best = max(row.expected_speedup for row in report.by_k)
    measured = [row.expected_speedup_measured for row in report.by_k if row.expected_speedup_measured is not None]
    if best < 1.0:
        found.append(f"no K pays: the best expected speedup is {best:.2f}x < 1; decode without speculation "
                     "or use a better draft")
    elif measured and max(measured) < 1.0:
        found.append(f"with the measured verification cost no K pays on this machine (best {max(measured):.2f}x)")
    if report.kl_mean is not None and report.kl_mean > KL_WARN:
        found.append(
            f"KL(p||q) = {report.kl_mean:.2f} > {KL_WARN}: the draft predicts the target poorly; "
            "`tandem distill` trains a draft on the target's own outputs"
        )
    return found


def calibrate(
    target_spec: str,
    draft_spec: str,
    prompts: Sequence[Prompt],
    max_tokens: int,
    max_k: int,
    device: str = "auto",
    dtype: str = "auto",
    cost_ratio: float | None = None,
    timing_steps: int = 8,
    on_prompt: Callable[[], None] | None = None,
) -> CalibrationReport:
    from tandem import models

    try:
        target = models.load_model(target_spec, device=device, dtype=dtype)
    except models.ModelSpecError as exc:
        raise CalibrateError(f"--target-model: {exc}") from exc
    drafter = load_drafter(draft_spec, target)
    total = Stats(max_k)
    by_domain: dict[str, Stats] = {}
    first: TargetPass | None = None
    for prompt in prompts:
        passed = target_pass(target, prompt.prompt, max_tokens, drafter.needs_hidden)
        first = first or passed
        stats = drafter.score(passed, max_k)
        total.add(stats)
        by_domain.setdefault(prompt.domain, Stats(max_k)).add(stats)
        if on_prompt is not None:
            on_prompt()
    if not total.positions:
        raise CalibrateError("no position was measured: every continuation ended at once (raise --max-tokens?)")
    verify_costs = None
    if cost_ratio is not None:
        cost = (None, None, cost_ratio, "--cost-ratio")
    else:
        assert first is not None
        prompt_ids = first.seq[: first.prompt_len].to(target.device)
        target_s = lm_step_seconds(target.model, prompt_ids, timing_steps)
        draft_s = drafter.step_seconds(first, timing_steps)
        cost = (target_s * 1e3, draft_s * 1e3, draft_s / target_s, f"measured at batch 1, median of {timing_steps} steps")
        continuation = first.seq[first.prompt_len :].to(target.device)
        if continuation.numel() == 0:
            continuation = prompt_ids[-1:]
        verify_costs = [
            lm_verify_seconds(target.model, prompt_ids, continuation.repeat(k + 1)[: k + 1], timing_steps) / target_s
            for k in range(1, max_k + 1)
        ]
    return build_report(target_spec, draft_spec, target, drafter, total, by_domain, len(prompts), max_tokens, max_k,
                        cost, verify_costs)
