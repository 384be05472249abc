"""Record real per-round token traces from a running gateway and replay them through the pacer.

Why: the smoothing goal (ITL p90/p50 <= 1.5 at a bounded extra delay) depends on how uneven the
rounds are, which depends on the draft. Measuring a pacer change on the live stack takes minutes
and is noisy; replaying recorded rounds through :class:`gateway.pacer.Pacer` on a fake clock takes
milliseconds and is exact, so pacer variants can be compared on the same rounds.

    python benchmarks/pacer_replay.py record --grpc 127.0.0.1:50051 --out /tmp/rounds.jsonl
    python benchmarks/pacer_replay.py replay /tmp/rounds.jsonl --max-delay-rounds 1 2 3

``record`` streams each bench prompt through ``tandem.v1.GatewayService/Generate`` with smoothing
off (greedy, speculation on), so every chunk is one upstream round: its arrival time and token count
are written, one JSON line per request. ``replay`` re-times each request with the pacer and reports
token-level ITL p50/p90, their ratio (pooled over all requests, as ``tandem bench`` pools them, with
bench's percentile and per-stream definitions) and
the mean extra delay per token, next to the raw (unpaced) figures.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from gateway.pacer import Pacer, PacerConfig
from tandem.tools.bench.metrics import itl_ratio, percentile


async def _record(grpc_address: str, prompts_path: Path, max_tokens: int, out: Path) -> None:
    import grpc

    from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    prompts = [json.loads(line) for line in prompts_path.read_text().splitlines() if line.strip()]
    async with grpc.aio.insecure_channel(grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with out.open("w") as sink:
            for index, item in enumerate(prompts):
                request = gateway_pb2.GatewayServiceGenerateRequest(
                    prompt=item["prompt"], max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                    speculation=common_pb2.SPECULATION_MODE_ON,
                    stream_smoothing=gateway_pb2.STREAM_SMOOTHING_OFF,
                )
                start = time.perf_counter()
                rounds: list[tuple[float, int]] = []
                async for chunk in stub.Generate(request):
                    if chunk.token_ids:
                        rounds.append((time.perf_counter() - start, len(chunk.token_ids)))
                sink.write(json.dumps({"domain": item.get("domain", ""), "rounds": rounds}) + "\n")
                print(f"{index + 1}/{len(prompts)} {item.get('domain', '')}: {len(rounds)} chunks", file=sys.stderr)


def replay(rounds: list[tuple[float, int]], config: PacerConfig) -> tuple[list[float], list[float]]:
    """(release times of every token, extra delay of every token) for one request's rounds.

    The first chunk (the prefill token) and the last one are handled as the gateway does: the first
    passes through the pacer like any batch, the end of the stream flushes the queue.
    """
    pacer: Pacer[float] = Pacer(config)
    releases: list[float] = []
    delays: list[float] = []

    def drain(until: float) -> None:
        while (due := pacer.next_release()) is not None and due <= until:
            for arrival in pacer.due(due):
                releases.append(due)
                delays.append(due - arrival)

    for arrival, count in rounds:
        drain(arrival)
        pacer.push([arrival] * count, arrival)
        drain(arrival)
    end = rounds[-1][0] if rounds else 0.0
    for arrival in pacer.flush():
        releases.append(end)
        delays.append(end - arrival)
    return releases, delays


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def _raw_releases(rounds: list[tuple[float, int]]) -> list[float]:
    """Unpaced: a round's tokens leave together, one chunk; ITL is per chunk."""
    return [arrival for arrival, _ in rounds]


def _report(name: str, per_request: list[list[float]], delays: list[float]) -> str:
    """Pooled ITL (as ``tandem bench`` pools it) and the median over requests of each stream's own
    p90/p50: pooling mixes streams of different speeds (json at 15 ms a token, prose at 30), so
    only the per-stream ratio measures the stutter one reader sees."""
    gaps = [g for request in per_request for g in request]
    p50, p90 = percentile(gaps, 0.5), percentile(gaps, 0.9)
    ratios = [r for r in (itl_ratio(request) for request in per_request) if r is not None]
    within = statistics.median(ratios) if ratios else float("nan")
    delay = f" mean extra delay {1000 * statistics.fmean(delays):6.1f} ms" if delays else ""
    return (f"{name:<28} ITL p50 {1000 * p50:6.1f} ms  p90 {1000 * p90:6.1f} ms  p90/p50 {p90 / p50:5.2f}"
            f"  within a stream {within:5.2f}{delay}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record per-round traces from a running gateway (gRPC)")
    rec.add_argument("--grpc", default="127.0.0.1:50051", help="gateway gRPC address")
    rec.add_argument("--prompts", type=Path, default=Path(__file__).resolve().parents[1] / "tandem/data/bench_prompts.jsonl")
    rec.add_argument("--max-tokens", type=int, default=64)
    rec.add_argument("--out", type=Path, required=True)
    rep = sub.add_parser("replay", help="replay traces through the pacer")
    rep.add_argument("traces", type=Path)
    rep.add_argument("--max-delay-rounds", type=float, nargs="+", default=[1.0])
    rep.add_argument("--window", type=int, default=PacerConfig().window)
    rep.add_argument("--rate-window", type=int, default=PacerConfig().rate_window)
    rep.add_argument("--gap-clip", type=float, default=PacerConfig().gap_clip)
    args = parser.parse_args(argv)
    if args.command == "record":
        asyncio.run(_record(args.grpc, args.prompts, args.max_tokens, args.out))
        return 0
    requests = [json.loads(line) for line in args.traces.read_text().splitlines() if line.strip()]
    traces = [[(float(t), int(n)) for t, n in r["rounds"]] for r in requests if r["rounds"]]
    raw_gaps = [_gaps(_raw_releases(rounds)) for rounds in traces]
    sizes = [n for rounds in traces for _, n in rounds[1:]]
    print(f"{len(traces)} requests, {len(sizes)} rounds, tokens per round mean {statistics.fmean(sizes):.2f} "
          f"sd {statistics.pstdev(sizes):.2f}")
    print(_report("raw (one chunk per round)", raw_gaps, []))
    for bound in args.max_delay_rounds:
        config = PacerConfig(max_delay_rounds=bound, window=args.window, rate_window=args.rate_window,
                             gap_clip=args.gap_clip)
        gaps: list[list[float]] = []
        delays: list[float] = []
        for rounds in traces:
            releases, extra = replay(rounds, config)
            gaps.append(_gaps(releases))
            delays += extra
        print(_report(f"paced, bound {bound:g} rounds", gaps, delays))
    return 0


if __name__ == "__main__":
    sys.exit(main())
