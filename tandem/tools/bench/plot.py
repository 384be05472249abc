"""``--plot FILE.png``: tokens/s by domain and mode (bars), and the ITL distribution (CDF per mode).

One colour per mode: tandem's modes and the HF peer keep fixed colours, URL peers take the next
free ones of matplotlib's palettes in report order (any number of them). matplotlib with the Agg
backend: no display needed, and nothing is imported unless asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tandem.tools.bench.client import AUTO, AUTOREGRESSIVE, PEER, SPECULATIVE, RequestResult
from tandem.tools.bench.metrics import percentile
from tandem.tools.bench.report import Report

_COLOURS = {SPECULATIVE: "#1f77b4", AUTOREGRESSIVE: "#ff7f0e", PEER: "#2ca02c", AUTO: "#9467bd"}


def mode_colours(modes: Sequence[str]) -> dict[str, str]:
    """A distinct colour per mode: the fixed ones, then tab10/tab20 colours not yet taken, cycling."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    taken = {_COLOURS[m] for m in modes if m in _COLOURS}
    palette = [to_hex(c) for name in ("tab10", "tab20") for c in colormaps[name].colors]
    spare = [c for c in dict.fromkeys(palette) if c not in taken] or palette
    colours, n = {}, 0
    for mode in modes:
        if mode in _COLOURS:
            colours[mode] = _COLOURS[mode]
        else:
            colours[mode] = spare[n % len(spare)]
            n += 1
    return colours


def _throughputs(report: Report) -> tuple[list[str], dict[str, list[float]]]:
    domains = ["all", *report.by_domain]
    per_mode: dict[str, list[float]] = {}
    for mode in report.overall:
        per_mode[mode] = [report.overall[mode].tokens_per_s] + [
            report.by_domain[d][mode].tokens_per_s if mode in report.by_domain[d] else 0.0 for d in report.by_domain
        ]
    if report.peer is not None:
        peer = report.peer
        per_mode[PEER] = [peer.overall.tokens_per_s] + [
            peer.by_domain[d].tokens_per_s if d in peer.by_domain else 0.0 for d in report.by_domain
        ]
    return domains, per_mode


def write_plot(report: Report, results: Sequence[RequestResult], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains, per_mode = _throughputs(report)
    colours = mode_colours(list(per_mode))
    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(1, len(per_mode))
    for i, (mode, values) in enumerate(per_mode.items()):
        xs = [d + (i - (len(per_mode) - 1) / 2) * width for d in range(len(domains))]
        label = "peer (HF assisted)" if mode == PEER else mode
        bars.bar(xs, values, width=width, label=label, color=colours[mode])
    bars.set_xticks(range(len(domains)), domains)
    bars.set_ylabel("tokens/s per request")
    speedup = "" if report.speedup is None else f" (speedup {report.speedup:.2f}x)"
    bars.set_title(f"{report.model}: tokens/s by domain{speedup}")
    bars.legend(fontsize="small")
    drew, all_positive = False, True
    for mode in per_mode:
        gaps = sorted(g * 1e3 for r in results if r.mode == mode and not r.error for g in r.chunk_gaps_s)
        if not gaps:
            continue
        all_positive = all_positive and gaps[0] > 0
        ys = [(i + 1) / len(gaps) for i in range(len(gaps))]
        cdf.step(gaps, ys, where="post", label=f"{mode} (p50 {percentile(gaps, 0.5):.0f} ms)", color=colours[mode])
        drew = True
    if drew and all_positive:
        cdf.set_xscale("log")
    cdf.set_xlabel("inter-token latency (ms, per streamed chunk)")
    cdf.set_ylabel("fraction of gaps")
    cdf.set_title("ITL distribution (CDF)")
    if drew:
        cdf.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=100)
    plt.close(fig)
