"""The bench report: per-mode summaries overall and per domain, speedups, and JSON.

``speedup`` is speculative tokens/s over autoregressive tokens/s *of the same run* (same prompts,
same max tokens, interleaved), the only ratio that means something on a shared machine;
``speedup_auto`` is the same for mode auto. Each URL peer's row sits in ``overall`` and
``by_domain`` under its mode name, beside tandem's modes; ``peers`` holds, per URL peer, tandem's
speedups over it and how many of its greedy outputs equal tandem's autoregressive ones. The text
table is ``tandem.tools.bench.table``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.tools.bench.client import AUTO, AUTOREGRESSIVE, MODES, SPECULATIVE, RequestResult, tandem_modes_of
from tandem.tools.bench.metrics import ModeSummary, ratio, summarize
from tandem.tools.bench.peers import UrlPeer, tokens_from


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
class UrlPeerReport:
    """One ``--peer-url`` server: its figures are ``Report.overall[mode]`` and ``by_domain[d][mode]``.

    ``speedup`` maps each tandem mode of the run to its tokens/s over the peer's.
    ``outputs_identical`` counts prompts whose text equals tandem's autoregressive text, out of
    ``outputs_compared`` answered by both; None when not compared (not greedy, or no mode off).
    """

    url: str
    mode: str
    model: str
    model_from: str
    completion_tokens_from: str | None  # "usage", "chunks" (streamed text chunks), "mixed", None
    speedup: dict[str, float | None] = field(default_factory=dict)
    speedup_by_domain: dict[str, dict[str, float | None]] = field(default_factory=dict)
    outputs_identical: int | None = None
    outputs_compared: int = 0
    failed: int = 0


@dataclass
class FastestPeer:
    """Each tandem mode against the fastest ``--peer-url`` server, overall and in each domain, where
    the fastest peer is picked per domain (a goal such as "1.5x the best of llama.cpp's modes in every
    domain" reads these). Present with two or more URL peers; with one, ``UrlPeerReport`` says it all."""

    overall_peer: str  # the fastest peer's mode label over all prompts
    speedup: dict[str, float | None] = field(default_factory=dict)  # tandem mode -> its tokens/s over that peer's
    peer_by_domain: dict[str, str] = field(default_factory=dict)  # domain -> the fastest peer there
    speedup_by_domain: dict[str, dict[str, float | None]] = field(default_factory=dict)


@dataclass
class Report:
    url: str
    model: str
    max_tokens: int
    speedup: float | None  # speculative / autoregressive tokens/s; None without both modes
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
    modes: list[str] = field(default_factory=list)  # tandem's modes of the run, in report order
    speedup_auto: float | None = None  # auto / autoregressive tokens/s
    speedup_auto_by_domain: dict[str, float | None] = field(default_factory=dict)
    auto_served_modes: dict[str, int] = field(default_factory=dict)  # mode auto: requests per served mode
    auto_fallbacks: int = 0  # mode auto: fallbacks summed over its requests
    peers: list[UrlPeerReport] = field(default_factory=list)
    fastest_peer: FastestPeer | None = None


def _texts(results: Sequence[RequestResult], mode: str) -> dict[int, str]:
    return {r.prompt_index: r.text for r in results if r.mode == mode and not r.error}


def outputs_identical(results: Sequence[RequestResult], mode_a: str, mode_b: str) -> bool | None:
    """Whether both modes produced the same text for every prompt both answered (greedy is
    lossless, so they must); None when no prompt was answered in both."""
    same, compared = identical_count(results, mode_a, mode_b)
    return same == compared if compared else None


def identical_count(results: Sequence[RequestResult], mode_a: str, mode_b: str) -> tuple[int, int]:
    """(prompts with the same text in both modes, prompts answered in both)."""
    a, b = _texts(results, mode_a), _texts(results, mode_b)
    common = a.keys() & b.keys()
    return sum(1 for i in common if a[i] == b[i]), len(common)


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


def _url_peer_report(
    peer: UrlPeer, results: Sequence[RequestResult], modes: Sequence[str], overall: dict[str, ModeSummary],
    by_domain: dict[str, dict[str, ModeSummary]], greedy: bool,
) -> UrlPeerReport:
    own = [r for r in results if r.mode == peer.mode]
    same, compared = identical_count(results, peer.mode, AUTOREGRESSIVE)
    compare = greedy and AUTOREGRESSIVE in modes
    return UrlPeerReport(
        url=peer.url,
        mode=peer.mode,
        model=peer.model,
        model_from=peer.model_from,
        completion_tokens_from=tokens_from(own),
        speedup={m: ratio(overall[m], overall[peer.mode]) for m in modes},
        speedup_by_domain={d: {m: ratio(s.get(m), s.get(peer.mode)) for m in modes} for d, s in by_domain.items()},
        outputs_identical=same if compare else None,
        outputs_compared=compared if compare else 0,
        failed=sum(1 for r in own if r.error),
    )


def _fastest_peer(
    labels: Sequence[str], modes: Sequence[str], overall: dict[str, ModeSummary],
    by_domain: dict[str, dict[str, ModeSummary]],
) -> FastestPeer | None:
    """Tandem's modes over the fastest of two or more URL peers (by tokens/s), overall and per domain."""
    if len(labels) < 2:
        return None

    def fastest(summaries: dict[str, ModeSummary]) -> str:
        return max(labels, key=lambda label: summaries[label].tokens_per_s if label in summaries else 0.0)

    best = fastest(overall)
    per_domain = {d: fastest(s) for d, s in by_domain.items()}
    return FastestPeer(
        overall_peer=best,
        speedup={m: ratio(overall[m], overall[best]) for m in modes},
        peer_by_domain=per_domain,
        speedup_by_domain={d: {m: ratio(s.get(m), s.get(per_domain[d])) for m in modes} for d, s in by_domain.items()},
    )


def _served_modes(results: Sequence[RequestResult]) -> tuple[dict[str, int], int]:
    """Mode auto: how many answered requests ended in each served mode, and the fallbacks."""
    ok = [r for r in results if r.mode == AUTO and not r.error]
    served = Counter(str(r.extra.get("served_mode") or "unknown") for r in ok)
    return dict(sorted(served.items())), sum(int(r.extra.get("fallbacks") or 0) for r in ok)


def build_report(
    url: str, model: str, max_tokens: int, results: Sequence[RequestResult], peer: PeerReport | None = None,
    duration_s: float = 0.0, config: dict | None = None, modes: Sequence[str] | None = None,
    url_peers: Sequence[UrlPeer] = (), greedy: bool = True,
) -> Report:
    """``modes``: tandem's modes of the run (default: those in ``results``, else on and off);
    ``greedy``: whether the temperature was 0 (peers' outputs are compared only then)."""
    modes = list(modes or tandem_modes_of(results) or MODES)
    columns = [*modes, *(p.mode for p in url_peers)]
    measured = [r for r in results if r.mode in columns]
    overall = {m: summarize([r for r in measured if r.mode == m]) for m in columns}
    domains = sorted({r.domain for r in measured})
    by_domain = {d: {m: summarize([r for r in measured if r.mode == m and r.domain == d]) for m in columns}
                 for d in domains}
    tandem_by_domain = {d: {m: s[m] for m in modes} for d, s in by_domain.items()}
    served, fallbacks = _served_modes(measured)

    def over(mode: str, base: str, summaries: dict[str, ModeSummary]) -> float | None:
        return ratio(summaries.get(mode), summaries.get(base))

    return Report(
        url=url,
        model=model,
        max_tokens=max_tokens,
        speedup=over(SPECULATIVE, AUTOREGRESSIVE, overall),
        overall=overall,
        by_domain=by_domain,
        outputs_identical=outputs_identical(measured, SPECULATIVE, AUTOREGRESSIVE) if greedy else None,
        speedup_by_domain=(
            {d: over(SPECULATIVE, AUTOREGRESSIVE, s) for d, s in tandem_by_domain.items()}
            if {SPECULATIVE, AUTOREGRESSIVE} <= set(modes) else {}
        ),
        peer=peer,
        speedup_vs_peer=ratio(overall.get(SPECULATIVE), peer.overall) if peer is not None else None,
        speedup_vs_peer_by_domain=(
            {d: ratio(s.get(SPECULATIVE), peer.by_domain.get(d)) for d, s in tandem_by_domain.items()}
            if peer is not None else {}
        ),
        duration_s=duration_s,
        config=dict(config or {}),
        errors=[f"{r.mode} prompt {r.prompt_index}: {r.error}" for r in results if r.error][:20],
        modes=modes,
        speedup_auto=over(AUTO, AUTOREGRESSIVE, overall),
        speedup_auto_by_domain=(
            {d: over(AUTO, AUTOREGRESSIVE, s) for d, s in tandem_by_domain.items()}
            if {AUTO, AUTOREGRESSIVE} <= set(modes) else {}
        ),
        auto_served_modes=served if AUTO in modes else {},
        auto_fallbacks=fallbacks,
        peers=[_url_peer_report(p, measured, modes, overall, by_domain, greedy) for p in url_peers],
        fastest_peer=_fastest_peer([p.mode for p in url_peers], modes, overall, by_domain),
    )


def write_json(report: Report, path: str | Path) -> None:
    Path(path).write_text(json.dumps(asdict(report), indent=2) + "\n")


def format_report(report: Report) -> str:
    """The text table (kept here for callers of ``tandem.tools.bench.report.format_report``)."""
    from tandem.tools.bench.table import format_report as table

    return table(report)
