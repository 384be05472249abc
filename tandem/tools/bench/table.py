"""The bench report as a text table: one row per mode (tandem's, the URL peers', the HF peer's),
overall then per domain, followed by the speedups and the output comparisons."""

from __future__ import annotations

from tandem.tools.bench.client import AUTO
from tandem.tools.bench.metrics import ModeSummary
from tandem.tools.bench.peers import MODELS_LIST
from tandem.tools.bench.report import Report

HF_PEER_LABEL = "peer (HF)"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _x(value: float | None) -> str:
    return f"{_fmt(value, '.2f')}x"


def _row(domain: str, mode: str, s: ModeSummary, width: int) -> str:
    return (
        f"{domain:<8} {mode:<{width}} {s.requests:>4} {s.tokens_per_s:>7.2f} {s.ttft_p50_s * 1e3:>7.0f}ms "
        f"{s.itl_p50_s * 1e3:>6.0f}ms {s.itl_p90_s * 1e3:>6.0f}ms {s.itl_p99_s * 1e3:>6.0f}ms "
        f"{_fmt(s.itl_p90_over_p50_per_stream, '.2f'):>7} "
        f"{s.tpot_s * 1e3:>5.0f}ms {_fmt(s.acceptance_rate, '.2f'):>7} {_fmt(s.mean_accepted_length, '.2f'):>8}"
    )


def _rows(report: Report) -> list[str]:
    width = max([15, len(HF_PEER_LABEL), *(len(m) for m in report.overall)])
    head = (f"{'domain':<8} {'mode':<{width}} {'reqs':>4} {'tok/s':>7} {'TTFT p50':>9} {'ITL p50':>8} "
            f"{'ITL p90':>8} {'ITL p99':>8} {'jitter':>7} {'TPOT':>7} {'accept':>7} {'mean len':>8}")
    lines = [head, "-" * len(head)]
    for domain, per_mode in [("all", report.overall), *report.by_domain.items()]:
        for mode, summary in per_mode.items():
            lines.append(_row(domain, mode, summary, width))
        if report.peer is not None:
            peer_summary = report.peer.overall if domain == "all" else report.peer.by_domain.get(domain)
            if peer_summary is not None:
                lines.append(_row(domain, HF_PEER_LABEL, peer_summary, width))
    lines.append("jitter: median over requests of each stream's ITL p90/p50 (the ITL columns pool all requests)")
    return lines


def _speedups(report: Report) -> list[str]:
    lines = []
    if report.speedup is not None or report.speedup_by_domain:
        lines.append(f"speedup (speculative / autoregressive tokens/s): {_x(report.speedup)}")
        per_domain = ", ".join(f"{d} {_x(v)}" for d, v in report.speedup_by_domain.items())
        if per_domain:
            lines.append(f"  by domain: {per_domain}")
    if report.speedup_auto is not None or report.speedup_auto_by_domain:
        lines.append(f"speedup (auto / autoregressive tokens/s): {_x(report.speedup_auto)}")
        per_domain = ", ".join(f"{d} {_x(v)}" for d, v in report.speedup_auto_by_domain.items())
        if per_domain:
            lines.append(f"  by domain: {per_domain}")
    if AUTO in report.modes:
        served = ", ".join(f"{mode} {n}" for mode, n in report.auto_served_modes.items()) or "none answered"
        lines.append(f"auto: requests by served mode: {served}; fallbacks: {report.auto_fallbacks}")
    return lines


def _url_peers(report: Report) -> list[str]:
    lines = []
    for peer in report.peers:
        lines.append(f"{peer.mode}: {peer.url}, model {peer.model!r}"
                     + ("" if peer.model_from == MODELS_LIST else f"; {peer.model_from}"))
        if peer.completion_tokens_from in ("chunks", "mixed"):
            why = "it sent no usage chunk" if peer.completion_tokens_from == "chunks" else "some answers had no usage"
            lines.append(f"  tokens counted from streamed text chunks ({why}), so its tokens/s and TPOT count chunks")
        for mode, value in peer.speedup.items():
            per_domain = ", ".join(f"{d} {_x(s.get(mode))}" for d, s in peer.speedup_by_domain.items())
            lines.append(f"  speedup ({mode} / peer tokens/s): {_x(value)}" + (f"; {per_domain}" if per_domain else ""))
        if peer.outputs_identical is None:
            lines.append("  outputs identical to autoregressive: not compared (needs --temperature 0 and mode off)")
        else:
            lines.append(f"  outputs identical to autoregressive: {peer.outputs_identical} of {peer.outputs_compared} "
                         "prompts (tokenizers or BOS handling may differ between servers)")
        if peer.failed:
            lines.append(f"  {peer.failed} request(s) to this peer failed")
    fastest = report.fastest_peer
    if fastest is not None:
        lines.append(f"against the fastest peer (overall {fastest.overall_peer}; per domain its own fastest):")
        for mode, value in fastest.speedup.items():
            per_domain = ", ".join(f"{d} {_x(s.get(mode))} ({fastest.peer_by_domain[d]})"
                                   for d, s in fastest.speedup_by_domain.items())
            lines.append(f"  {mode}: {_x(value)}" + (f"; {per_domain}" if per_domain else ""))
    return lines


def format_report(report: Report) -> str:
    lines = [*_rows(report), *_speedups(report), *_url_peers(report)]
    if report.peer is not None:
        peer = report.peer
        lines.append(
            f"peer: transformers assisted generation, {peer.assistant}, K={peer.num_assistant_tokens}, "
            f"in-process on {peer.device} ({peer.dtype}), one request at a time"
        )
        lines.append(f"speedup vs peer (speculative / peer tokens/s): {_x(report.speedup_vs_peer)}")
        identical = peer.outputs_identical_to_autoregressive
        why = (f" (the peer decodes the checkpoint in {peer.dtype}; a server computing otherwise, e.g. on a GGUF "
               "file's quantized blocks, may take the other side of a near-tie)") if identical is False else ""
        lines.append(f"peer outputs identical to autoregressive: {identical}{why}")
    if report.outputs_identical is not None:
        lines.append(f"greedy outputs identical across modes: {report.outputs_identical}")
    failed = {mode: s.failed for mode, s in report.overall.items() if s.failed}
    if failed:
        per_mode = ", ".join(f"{mode} {n}" for mode, n in failed.items())
        lines.append(f"{sum(failed.values())} request(s) failed ({per_mode}), e.g. {report.errors[0]}")
    return "\n".join(lines)
