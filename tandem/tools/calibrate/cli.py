"""``tandem calibrate`` flags, the text report and ``--json``."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # run imports torch: `tandem serve` and every other command start without it
    from tandem.tools.calibrate.run import CalibrationReport


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target-model", default="gemma-3-270m", help="target SPEC (default gemma-3-270m)")
    parser.add_argument("--draft-model", required=True,
                        help="an HF draft SPEC with the target's tokenizer, 'eagle' (the head shipped for the "
                             "target), an eagle head directory, or 'ngram' (match rate only)")
    parser.add_argument("--prompts", default=None,
                        help="JSONL with {domain, prompt} rows (default: the bench prompt set)")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts to run (default 16; 0 = all)")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens the target generates per prompt")
    parser.add_argument("--max-k", type=int, default=8, help="largest K considered (default 8)")
    parser.add_argument("--cost-ratio", type=float, default=None, metavar="C",
                        help="draft step / target step cost to assume instead of measuring it (e.g. for "
                             "another machine)")
    parser.add_argument("--timing-steps", type=int, default=8, help="decode steps timed per model (median)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    parser.add_argument("--json", dest="json_path", default=None, help="write the report as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (also off when stderr is no TTY)")


def _check(args: argparse.Namespace) -> None:
    problems = []
    if args.num_prompts < 0:
        problems.append(f"--num-prompts must be >= 0 (got {args.num_prompts})")
    if args.max_tokens < 2:
        problems.append(f"--max-tokens must be >= 2 (got {args.max_tokens})")
    if not 1 <= args.max_k <= 64:
        problems.append(f"--max-k must be in 1..64 (got {args.max_k})")
    if args.cost_ratio is not None and args.cost_ratio < 0:
        problems.append(f"--cost-ratio must be >= 0 (got {args.cost_ratio})")
    if args.timing_steps < 1:
        problems.append(f"--timing-steps must be >= 1 (got {args.timing_steps})")
    if problems:
        raise SystemExit("tandem calibrate: " + "; ".join(problems))


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def format_report(r: CalibrationReport) -> str:
    lines = [
        (f"target {r.target_model} ({r.target_precision}) vs {r.draft_description}"
        f"{f' ({r.draft_precision})' if r.draft_precision else ''}"),
        (f"{r.prompts} prompts, {r.positions} positions, greedy continuations of {r.max_tokens} tokens, "
        f"{r.device} {r.dtype}"),
        (f"KL(p||q) mean {_fmt(r.kl_mean)}   acceptance a = E[sum min(p, q)] {_fmt(r.acceptance_rate)}   "
        f"greedy acceptance P[argmax q = argmax p] {r.greedy_acceptance:.3f}"),
    ]
    if r.p_mass_outside_draft_vocab is not None:
        lines.append(f"target probability outside the head's reduced vocabulary: {r.p_mass_outside_draft_vocab:.3f}")
    lines.append("acceptance by depth: " + " ".join(f"{a:.3f}" for a in r.acceptance_by_depth))
    if r.target_step_ms is not None:
        lines.append(f"cost: target step {r.target_step_ms:.2f} ms, draft step {r.draft_step_ms:.3f} ms, "
                     f"c = {r.cost_ratio:.3f} ({r.cost_ratio_source})")
    else:
        lines.append(f"cost: c = {r.cost_ratio:.3f} ({r.cost_ratio_source})")
    measured = any(row.verify_cost is not None for row in r.by_k)
    lines.append(f"{'K':>3} {'E[tokens/round]':>16} {'E[accepted]':>12} {'E[speedup]':>11} {'greedy tok/round':>17} "
                 f"{'greedy speedup':>15}" + (f" {'verify cost':>12} {'E[speedup] measured':>20}" if measured else ""))
    for row in r.by_k:
        line = (f"{row.k:>3} {row.expected_tokens_per_round:>16.3f} {row.expected_accepted_length:>12.3f} "
                f"{row.expected_speedup:>10.3f}x {_fmt(row.greedy_tokens_per_round):>17} "
                f"{_fmt(row.greedy_speedup):>14}x")
        if measured:
            line += f" {_fmt(row.verify_cost, '.2f'):>12} {_fmt(row.expected_speedup_measured):>19}x"
        lines.append(line)
    lines.append(f"recommended K = {r.recommended_k} (basis: {r.recommendation_basis}); "
                 f"from greedy runs: {r.recommended_k_greedy if r.recommended_k_greedy is not None else '-'}")
    if r.recommended_k_measured_verify is not None:
        lines.append(f"with the measured verification cost (the paper takes it as one target step): "
                     f"K = {r.recommended_k_measured_verify}")
    lines.append(f"formula: {r.formula}")
    if len(r.by_domain) > 1:
        lines.append(f"{'domain':<10} {'positions':>9} {'KL':>7} {'accept':>7} {'greedy':>7}")
        for domain, d in r.by_domain.items():
            lines.append(f"{domain:<10} {d.positions:>9} {_fmt(d.kl_mean):>7} {_fmt(d.acceptance_rate):>7} "
                         f"{_fmt(d.greedy_acceptance):>7}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    _check(args)
    from tqdm import tqdm

    from tandem.tools.bench.prompts import PromptFileError, load_prompts
    from tandem.tools.calibrate.drafts import CalibrateError
    from tandem.tools.calibrate.run import calibrate

    try:
        prompts = load_prompts(args.prompts, args.num_prompts)
    except PromptFileError as exc:
        raise SystemExit(f"tandem calibrate: {exc}") from exc
    bar = tqdm(total=len(prompts), desc="calibrate", unit="prompt", file=sys.stderr,
               disable=args.no_progress or not sys.stderr.isatty())
    try:
        report = calibrate(args.target_model, args.draft_model, prompts, args.max_tokens, args.max_k, args.device,
                           args.dtype, args.cost_ratio, args.timing_steps, on_prompt=lambda: bar.update(1))
    except CalibrateError as exc:
        raise SystemExit(f"tandem calibrate: {exc}") from exc
    finally:
        bar.close()
    print(format_report(report))
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0
