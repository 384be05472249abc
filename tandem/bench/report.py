"""The bench report: per-mode summaries overall and per domain, speedups, text table and JSON.

``speedup`` is speculative tokens/s over autoregressive tokens/s *of the same run* (same prompts,
same max tokens, interleaved), the only ratio that means something on a shared machine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.bench.client import AUTOREGRESSIVE, MODES, SPECULATIVE, RequestResult
from tandem.bench.metrics import ModeSummary, ratio, summarize


@dataclass
class PeerReport:
    """transformers' assisted generation of the same prompts, in-process, one request at a time."""

    assistant: str  # which candidate generator: "model <spec>" or "prompt lookup"
    target_model: str
    num_assistant_tokens: int
    overall: ModeSummary
    by_domain: dict[str, ModeSummary] = field(default_factory=dict)
    outputs_identical_to_autoregressive: bool | None = None
    device: str = "cpu"
    dtype: str = "float32"


@dataclass
class Report:
    url: str
    model: str
    max_tokens: int
    speedup: float
    overall: dict[str, ModeSummary]
    by_domain: dict[str, dict[str, ModeSummary]] = field(default_factory=dict)
    outputs_identical: bool | None = None
    speedup_by_domain: dict[str, float | None] = field(default_factory=dict)
    peer: PeerReport | None = None
    speedup_vs_peer: float | None = None
    speedup_vs_peer_by_domain: dict[str, float | None] = field(default_factory=dict)
    duration_s: float = 0.0
    config: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def _texts(results: Sequence[RequestResult], mode: str) -> dict[int, str]:
    return {r.prompt_index: r.text for r in results if r.mode == mode and not r.error}


def outputs_identical(results: Sequence[RequestResult], mode_a: str, mode_b: str) -> bool | None:
    """Whether both modes produced the same text for every prompt both answered (greedy is
    lossless, so they must); None when no prompt was answered in both."""
    a, b = _texts(results, mode_a), _texts(results, mode_b)
    common = sorted(a.keys() & b.keys())
    return all(a[i] == b[i] for i in common) if common else None


def summarize_peer(
    results: Sequence[RequestResult], stack_results: Sequence[RequestResult], assistant: str, target_model: str,
    num_assistant_tokens: int, device: str = "cpu", dtype: str = "float32",
) -> PeerReport:
    domains = sorted({r.domain for r in results})
    merged = [*results, *stack_results]
    return PeerReport(
        assistant=assistant,
        target_model=target_model,
        num_assistant_tokens=num_assistant_tokens,
        overall=summarize(results),
        by_domain={d: summarize([r for r in results if r.domain == d]) for d in domains},
        outputs_identical_to_autoregressive=outputs_identical(merged, "peer", AUTOREGRESSIVE),
        device=device,
        dtype=dtype,
    )


def build_report(
    url: str, model: str, max_tokens: int, results: Sequence[RequestResult], peer: PeerReport | None = None,
    duration_s: float = 0.0, config: dict | None = None,
) -> Report:
    stack = [r for r in results if r.mode in MODES]
    overall = {m: summarize([r for r in stack if r.mode == m]) for m in MODES}
    domains = sorted({r.domain for r in stack})
    by_domain = {d: {m: summarize([r for r in stack if r.mode == m and r.domain == d]) for m in MODES} for d in domains}
    speedup_by_domain = {d: ratio(s[SPECULATIVE], s[AUTOREGRESSIVE]) for d, s in by_domain.items()}
    vs_peer_by_domain = (
        {d: ratio(by_domain[d][SPECULATIVE], peer.by_domain.get(d)) for d in domains} if peer is not None else {}
    )
    return Report(
        url=url,
        model=model,
        max_tokens=max_tokens,
        speedup=ratio(overall[SPECULATIVE], overall[AUTOREGRESSIVE]) or 0.0,
        overall=overall,
        by_domain=by_domain,
        outputs_identical=outputs_identical(stack, SPECULATIVE, AUTOREGRESSIVE),
        speedup_by_domain=speedup_by_domain,
        peer=peer,
        speedup_vs_peer=ratio(overall[SPECULATIVE], peer.overall) if peer is not None else None,
        speedup_vs_peer_by_domain=vs_peer_by_domain,
        duration_s=duration_s,
        config=dict(config or {}),
        errors=[f"{r.mode} prompt {r.prompt_index}: {r.error}" for r in results if r.error][:20],
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _row(domain: str, mode: str, s: ModeSummary) -> str:
    return (
        f"{domain:<8} {mode:<15} {s.requests:>4} {s.tokens_per_s:>7.2f} {s.ttft_p50_s * 1e3:>7.0f}ms "
        f"{s.itl_p50_s * 1e3:>6.0f}ms {s.itl_p90_s * 1e3:>6.0f}ms {s.itl_p99_s * 1e3:>6.0f}ms "
        f"{_fmt(s.itl_p90_over_p50_per_stream, '.2f'):>7} "
        f"{s.tpot_s * 1e3:>5.0f}ms {_fmt(s.acceptance_rate, '.2f'):>7} {_fmt(s.mean_accepted_length, '.2f'):>8}"
    )


def format_report(report: Report) -> str:
    head = (f"{'domain':<8} {'mode':<15} {'reqs':>4} {'tok/s':>7} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p90':>8} "
            f"{'ITL p99':>8} {'jitter':>7} {'TPOT':>7} {'accept':>7} {'mean len':>8}")
    lines = [head, "-" * len(head)]
    for domain, per_mode in [("all", report.overall), *report.by_domain.items()]:
        for mode, summary in per_mode.items():
            lines.append(_row(domain, mode, summary))
        if report.peer is not None:
            peer_summary = report.peer.overall if domain == "all" else report.peer.by_domain.get(domain)
            if peer_summary is not None:
                lines.append(_row(domain, "peer (HF)", peer_summary))
    lines.append("jitter: median over requests of each stream's ITL p90/p50 (the ITL columns pool all requests)")
    lines.append(f"speedup (speculative / autoregressive tokens/s): {report.speedup:.2f}x")
    per_domain = ", ".join(f"{d} {_fmt(v, '.2f')}x" for d, v in report.speedup_by_domain.items())
    if per_domain:
        lines.append(f"  by domain: {per_domain}")
    if report.peer is not None:
        peer = report.peer
        lines.append(
            f"peer: transformers assisted generation, {peer.assistant}, K={peer.num_assistant_tokens}, "
            f"in-process on {peer.device} ({peer.dtype}), one request at a time"
        )
        lines.append(f"speedup vs peer (speculative / peer tokens/s): {_fmt(report.speedup_vs_peer, '.2f')}x")
        lines.append(f"peer outputs identical to autoregressive: {peer.outputs_identical_to_autoregressive}")
    lines.append(f"greedy outputs identical across modes: {report.outputs_identical}")
    failed = sum(s.failed for s in report.overall.values())
    if failed:
        lines.append(f"{failed} request(s) failed, e.g. {report.errors[0]}")
    return "\n".join(lines)


def write_json(report: Report, path: str | Path) -> None:
    Path(path).write_text(json.dumps(asdict(report), indent=2) + "\n")
