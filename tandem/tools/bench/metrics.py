"""Per-mode figures from per-request measurements.

Definitions (the usual ones of vLLM's and SGLang's serving benchmarks):
- TTFT: request sent -> first streamed text chunk.
- ITL: the gap between consecutive streamed text chunks (a chunk may carry several tokens when a
  speculative round commits them at once and stream smoothing is off). Percentiles pool the gaps
  of all requests; ``itl_p90_over_p50_per_stream`` is the median over requests of each stream's own
  ITL p90/p50, the stutter one reader sees (pooling mixes streams of different speeds: even
  perfectly paced json at 15 ms a token and prose at 30 ms pool to a ratio near 2).
- TPOT: (e2e - TTFT) / (completion tokens - 1) per request, then averaged / percentiled.
- tokens/s: completion tokens / summed request latency, i.e. the decode speed one stream sees;
  with concurrency > 1 both modes share the load, so their ratio is still a fair speedup.
- acceptance rate: accepted draft tokens / drafted tokens.
- mean accepted length: tokens committed per target verification ((accepted + rounds) / rounds),
  the same quantity as E[tokens per round] in the speculative decoding paper.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.tools.bench.client import RequestResult


@dataclass
class ModeSummary:
    requests: int
    completion_tokens: int
    tokens_per_s: float
    ttft_p50_s: float
    itl_p50_s: float
    itl_p90_s: float
    itl_p99_s: float
    tpot_s: float
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    failed: int = 0
    ttft_mean_s: float = 0.0
    ttft_p90_s: float = 0.0
    ttft_p99_s: float = 0.0
    itl_mean_s: float = 0.0
    tpot_p50_s: float = 0.0
    tpot_p90_s: float = 0.0
    tpot_p99_s: float = 0.0
    e2e_p50_s: float = 0.0
    itl_p90_over_p50_per_stream: float | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first; None for requests of fewer than two tokens."""
    if result.completion_tokens < 2:
        return None
    return (result.e2e_s - result.ttft_s) / (result.completion_tokens - 1)


def itl_ratio(gaps: Sequence[float]) -> float | None:
    """ITL p90 / p50 of one stream; None under 3 gaps or with a zero median."""
    if len(gaps) < 3:
        return None
    p50 = percentile(gaps, 0.5)
    return percentile(gaps, 0.9) / p50 if p50 > 0 else None


def summarize(results: Sequence[RequestResult]) -> ModeSummary:
    failed = sum(1 for r in results if r.error)
    ok = [r for r in results if not r.error]
    tokens = sum(r.completion_tokens for r in ok)
    wall = sum(r.e2e_s for r in ok)
    ttfts = [r.ttft_s for r in ok]
    gaps = [g for r in ok for g in r.chunk_gaps_s]
    tpots = [t for t in (tpot(r) for r in ok) if t is not None]
    stream_ratios = [x for x in (itl_ratio(r.chunk_gaps_s) for r in ok) if x is not None]
    rounds = sum(r.rounds for r in ok)
    drafted = sum(r.draft_tokens for r in ok)
    accepted = sum(r.accepted_tokens for r in ok)
    return ModeSummary(
        requests=len(ok),
        completion_tokens=tokens,
        tokens_per_s=tokens / wall if wall else 0.0,
        ttft_p50_s=percentile(ttfts, 0.5),
        itl_p50_s=percentile(gaps, 0.5),
        itl_p90_s=percentile(gaps, 0.9),
        itl_p99_s=percentile(gaps, 0.99),
        tpot_s=statistics.fmean(tpots) if tpots else 0.0,
        acceptance_rate=accepted / drafted if drafted else None,
        mean_accepted_length=(accepted + rounds) / rounds if rounds else None,
        failed=failed,
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
        ttft_p90_s=percentile(ttfts, 0.9),
        ttft_p99_s=percentile(ttfts, 0.99),
        itl_mean_s=statistics.fmean(gaps) if gaps else 0.0,
        tpot_p50_s=percentile(tpots, 0.5),
        tpot_p90_s=percentile(tpots, 0.9),
        tpot_p99_s=percentile(tpots, 0.99),
        e2e_p50_s=percentile([r.e2e_s for r in ok], 0.5),
        itl_p90_over_p50_per_stream=statistics.median(stream_ratios) if stream_ratios else None,
    )


def ratio(numerator: ModeSummary | None, denominator: ModeSummary | None) -> float | None:
    """tokens/s of one mode over another's; None when either is missing, the numerator answered no
    request or the denominator has no throughput."""
    if numerator is None or denominator is None or not numerator.requests or not denominator.tokens_per_s:
        return None
    return numerator.tokens_per_s / denominator.tokens_per_s
