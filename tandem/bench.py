"""``tandem bench``: speculative against autoregressive decoding of the same prompts, in one run.

Each prompt is sent once with ``speculation: "on"`` and once with ``"off"`` through a running
gateway's streaming completions API, interleaved (the order alternates per prompt) so both modes
see the same machine load. Reports TTFT, ITL percentiles, TPOT, tokens/s, acceptance rate and mean
accepted length (tokens committed per target verification), overall and per domain; ``--json``
writes the report with a top-level ``speedup`` (speculative / autoregressive tokens/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import httpx

MODES = ("speculative", "autoregressive")
_SPECULATION = {"speculative": "on", "autoregressive": "off"}


@dataclass
class Prompt:
    domain: str
    prompt: str


@dataclass
class RequestResult:
    domain: str
    mode: str
    completion_tokens: int
    ttft_s: float
    e2e_s: float
    chunk_gaps_s: list[float]
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    text: str = ""


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


@dataclass
class Report:
    url: str
    model: str
    max_tokens: int
    speedup: float
    overall: dict[str, ModeSummary]
    by_domain: dict[str, dict[str, ModeSummary]] = field(default_factory=dict)
    outputs_identical: bool | None = None


def load_prompts(path: str | None) -> list[Prompt]:
    text = Path(path).read_text() if path else resources.files("tandem.data").joinpath("bench_prompts.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [Prompt(row.get("domain", "all"), row["prompt"]) for row in rows]


def run_one(
    client: httpx.Client, url: str, model: str, prompt: Prompt, mode: str, max_tokens: int,
    stream_smoothing: str | None = None,
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt.prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculation": _SPECULATION[mode],
    }
    if stream_smoothing is not None:  # else the gateway's --stream-smoothing
        body["stream_smoothing"] = stream_smoothing
    start = time.perf_counter()
    stamps: list[float] = []
    usage: dict = {}
    text = []
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message"))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    stamps.append(time.perf_counter())
                    text.append(choice["text"])
    end = time.perf_counter()
    spec = usage.get("speculative_decoding") or {}
    return RequestResult(
        domain=prompt.domain,
        mode=mode,
        completion_tokens=int(usage.get("completion_tokens", 0)),
        ttft_s=(stamps[0] if stamps else end) - start,
        e2e_s=end - start,
        chunk_gaps_s=[b - a for a, b in zip(stamps, stamps[1:])],
        rounds=int(spec.get("rounds", 0)),
        draft_tokens=int(spec.get("draft_tokens", 0)),
        accepted_tokens=int(spec.get("accepted_tokens", 0)),
        text="".join(text),
    )


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarize(results: list[RequestResult]) -> ModeSummary:
    tokens = sum(r.completion_tokens for r in results)
    wall = sum(r.e2e_s for r in results)
    gaps = [g for r in results for g in r.chunk_gaps_s]
    tpots = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in results if r.completion_tokens > 1]
    rounds = sum(r.rounds for r in results)
    drafted = sum(r.draft_tokens for r in results)
    accepted = sum(r.accepted_tokens for r in results)
    return ModeSummary(
        requests=len(results),
        completion_tokens=tokens,
        tokens_per_s=tokens / wall if wall else 0.0,
        ttft_p50_s=_pct([r.ttft_s for r in results], 0.5),
        itl_p50_s=_pct(gaps, 0.5),
        itl_p90_s=_pct(gaps, 0.9),
        itl_p99_s=_pct(gaps, 0.99),
        tpot_s=statistics.fmean(tpots) if tpots else 0.0,
        acceptance_rate=accepted / drafted if drafted else None,
        mean_accepted_length=(accepted + rounds) / rounds if rounds else None,
    )


def build_report(url: str, model: str, max_tokens: int, results: list[RequestResult]) -> Report:
    overall = {m: summarize([r for r in results if r.mode == m]) for m in MODES}
    domains = sorted({r.domain for r in results})
    by_domain = {d: {m: summarize([r for r in results if r.mode == m and r.domain == d]) for m in MODES} for d in domains}
    ar = overall["autoregressive"].tokens_per_s
    spec_texts = [r.text for r in results if r.mode == "speculative"]
    ar_texts = [r.text for r in results if r.mode == "autoregressive"]
    return Report(
        url=url,
        model=model,
        max_tokens=max_tokens,
        speedup=overall["speculative"].tokens_per_s / ar if ar else 0.0,
        overall=overall,
        by_domain=by_domain,
        outputs_identical=spec_texts == ar_texts,
    )


def format_report(report: Report) -> str:
    head = f"{'domain':<8} {'mode':<15} {'tok/s':>7} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p90':>8} {'ITL p99':>8} {'TPOT':>7} {'accept':>7} {'mean len':>8}"
    lines = [head, "-" * len(head)]
    rows = [("all", report.overall), *report.by_domain.items()]
    for domain, per_mode in rows:
        for mode, s in per_mode.items():
            acc = f"{s.acceptance_rate:.2f}" if s.acceptance_rate is not None else "-"
            mal = f"{s.mean_accepted_length:.2f}" if s.mean_accepted_length is not None else "-"
            lines.append(
                f"{domain:<8} {mode:<15} {s.tokens_per_s:>7.2f} {s.ttft_p50_s * 1e3:>7.0f}ms {s.itl_p50_s * 1e3:>6.0f}ms "
                f"{s.itl_p90_s * 1e3:>6.0f}ms {s.itl_p99_s * 1e3:>6.0f}ms {s.tpot_s * 1e3:>5.0f}ms {acc:>7} {mal:>8}"
            )
    lines.append(f"speedup (speculative / autoregressive tokens/s): {report.speedup:.2f}x")
    lines.append(f"greedy outputs identical across modes: {report.outputs_identical}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    parser.add_argument("--model", default=None, help="model id (default: the gateway's first model)")
    parser.add_argument("--prompts", default=None, help="JSONL with {domain, prompt} rows (default: built-in set)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0 = all)")
    parser.add_argument("--warmup", type=int, default=1, help="requests per mode before measuring")
    parser.add_argument("--json", dest="json_path", default=None, help="write the report as JSON here")
    parser.add_argument("--stream-smoothing", choices=("off", "auto"), default=None,
                        help="the stream_smoothing field of each request (default: the gateway's setting)")


def main(args: argparse.Namespace) -> int:
    prompts = load_prompts(args.prompts)
    if args.limit:
        prompts = prompts[: args.limit]
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        model = args.model or client.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        for mode in MODES[: 2 if args.warmup else 0]:
            for prompt in prompts[: args.warmup]:
                run_one(client, args.url, model, prompt, mode, min(8, args.max_tokens))
        results: list[RequestResult] = []
        for index, prompt in enumerate(prompts):
            order = MODES if index % 2 == 0 else MODES[::-1]
            for mode in order:
                results.append(run_one(client, args.url, model, prompt, mode, args.max_tokens, args.stream_smoothing))
            print(f"\r[{index + 1}/{len(prompts)}] {prompt.domain:<8}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    report = build_report(args.url, model, args.max_tokens, results)
    print(format_report(report))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(asdict(report), indent=2))
    return 0
