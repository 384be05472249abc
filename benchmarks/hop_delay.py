"""Speculative decoding across a slow draft-target hop: tokens/s against the one-way delay, for
the synchronous loop (``--pipeline-depth 1``) beside pipelined ones.

One target, and for each pipeline depth a draft and a gateway as ``tandem serve`` starts them
(its own child commands, on free ports). Every draft reaches the target through one delaying TCP
proxy (``tandem.tools.bench.delay_proxy``), so every block and verdict crosses a link of the
chosen one-way latency; the gateways reach the target directly (autoregressive decoding never
crosses the hop). One delay after another (a link's delay is stable, and the drafts learn it:
``--warmup`` prompts at each delay go unmeasured), each prompt is sent in every mode, interleaved:
speculation forced on through each depth's gateway, off (autoregressive), and ``auto`` (the
default: falls back where speculation does not pay) through the last depth's. Reported per
delay: tokens/s (the bench's definition: completion tokens over request time) of each, the speedup
of on over off, on's tokens/s relative to delay 0 and its speedup relative to delay 0's (``on/off
vs 0 ms``, which a host whose speed drifts between delays moves less than raw tokens/s), the mean
committed tokens per round, and for pipelined depths the share of blocks sent on an assumption that
came back stale (``tandem_spec_decode_pipelined_blocks_total``).

A lane written ``2+near`` (``--depths 1,2,2+near``) gives its gateway a second draft, of the
kind ``--near-draft`` names (default ``ngram``), that reaches the target directly (a draft run
beside the target); the gateway places each speculative leg on the draft that measured more
committed tokens per second (docs/fleet.md#placement), and the table adds the share of rounds the
near draft served.

    python benchmarks/hop_delay.py --delays-ms 0,1,5,20 --depths 1,2 --limit 12 --plot hop.png
    python benchmarks/hop_delay.py --delays-ms 0,5,20 --depths 1,2,1+near,2+near
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tandem.config import ServeSettings
from tandem.supervisor import child_commands, is_serving
from tandem.tools.bench.client import AUTO, AUTOREGRESSIVE, SPECULATIVE, RequestOptions, run_one, served_model
from tandem.tools.bench.delay_proxy import DelayProxy
from tandem.tools.bench.metrics import summarize
from tandem.tools.bench.prompts import load_prompts
from tandem.tools.bench.stack import free_ports


class ProxyThread:
    """The proxy on an event loop of its own, so the bench can block on HTTP meanwhile."""

    def __init__(self, upstream: str) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.proxy = asyncio.run_coroutine_threadsafe(DelayProxy(upstream).start(), self.loop).result(10)

    def set_delay_ms(self, delay_ms: float) -> None:
        self.loop.call_soon_threadsafe(setattr, self.proxy, "delay_s", delay_ms / 1000)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@dataclass
class Lane:
    """One pipeline depth: its draft (through the proxy), maybe a near draft, and the gateway in front."""

    label: str  # as given in --depths: "2", "2+near"
    depth: int
    url: str  # the gateway's HTTP
    metrics_url: str  # the far draft's /metrics
    near_metrics_url: str | None = None  # the near draft's
    near_address: str = ""

    def blocks(self) -> tuple[float, float, float, float]:
        """(the far draft's verified rounds, its pipelined blocks that held, ones that came back
        stale, the near draft's verified rounds) so far."""
        far = _metrics(self.metrics_url)
        near = _metrics(self.near_metrics_url) if self.near_metrics_url else {}
        return (far.get("rounds", 0.0), far.get("held", 0.0), far.get("stale", 0.0), near.get("rounds", 0.0))


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url, timeout=10).text

    def value(pattern: str) -> float:
        match = re.search(pattern + r"\s+([0-9.e+-]+)", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    return {"rounds": value(r"^tandem_spec_decode_num_drafts_total"),
            "held": value(r'tandem_spec_decode_pipelined_blocks_total\{outcome="verified"\}'),
            "stale": value(r'tandem_spec_decode_pipelined_blocks_total\{outcome="stale"\}')}


def start_services(args: argparse.Namespace, depths: list[str], log_dir: Path) -> tuple[list[subprocess.Popen], list[Lane], ProxyThread]:
    ports = iter(free_ports(1 + 6 * len(depths)))  # distinct: one target, then per lane 4 + 2 near
    target_port = next(ports)
    proxy = ProxyThread(f"127.0.0.1:{target_port}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") or k == "TANDEM_CACHE_DIR"}
    processes: list[subprocess.Popen] = []
    lanes = []
    for index, label in enumerate(depths):
        depth, with_near = lane_of(label)
        settings = ServeSettings(
            target_model=args.target_model, draft_model=args.draft_model, http_port=next(ports),
            grpc_port=next(ports), draft_port=next(ports), target_port=target_port, draft_metrics_port=next(ports),
            target_metrics_port=0, log_level="warning", stream_smoothing="off",
            **({"num_speculative_tokens": args.k} if args.k else {}),
        )
        near_port, near_metrics_port = next(ports), next(ports)
        children = []
        for child in child_commands(settings):
            argv = list(child.argv)
            if child.name.startswith("target"):
                if index:
                    continue  # one target serves every lane
                argv += args.target_arg
            if child.name.startswith("draft"):
                if with_near:  # beside the target: no proxy, its own ports and kind
                    near = _with(argv, {"--draft-model": args.near_draft, "--port": str(near_port),
                                        "--metrics-port": str(near_metrics_port)})
                    children.append(("near-draft", near + [f"--pipeline-depth={depth}"], f"127.0.0.1:{near_port}",
                                     child.env))
                # the draft reaches the target through the proxy
                argv = _with(argv, {"--target-address": proxy.proxy.address}) + [f"--pipeline-depth={depth}",
                                                                                  *args.draft_arg]
            if child.name == "gateway" and with_near:
                far = argv[argv.index("--draft-address") + 1]
                argv = _with(argv, {"--draft-address": f"{far},127.0.0.1:{near_port}"})
            children.append((child.name, argv, child.health_address, child.env))
        for child_name, argv, health_address, child_env in children:
            name = f"{child_name}-{label}"
            with open(log_dir / f"{name}.log", "w") as log:
                processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                  env={**env, **child_env}, start_new_session=True))
            deadline = time.monotonic() + args.ready_timeout_s
            while not is_serving(health_address, timeout=1.0):
                if processes[-1].poll() is not None or time.monotonic() > deadline:
                    stop(processes)
                    raise SystemExit(f"{name} did not start: {(log_dir / f'{name}.log').read_text()[-2000:]}")
                time.sleep(0.5)
        lanes.append(Lane(label, depth, f"http://127.0.0.1:{settings.http_port}",
                          f"http://127.0.0.1:{settings.draft_metrics_port}/metrics",
                          f"http://127.0.0.1:{near_metrics_port}/metrics" if with_near else None,
                          f"127.0.0.1:{near_port}" if with_near else ""))
    return processes, lanes, proxy


def lane_of(label: str) -> tuple[int, bool]:
    """``"2+near"`` -> (2, True): a lane's pipeline depth and whether it has a near draft."""
    depth, _, near = label.partition("+")
    if not depth.isdigit() or int(depth) < 1 or near not in ("", "near"):
        raise SystemExit(f"bad lane {label!r}: a pipeline depth, maybe with '+near' (e.g. 2+near)")
    return int(depth), near == "near"


def _with(argv: list[str], values: dict[str, str]) -> list[str]:
    """``argv`` with the values of the given flags replaced."""
    out = list(argv)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


def stop(processes: list[subprocess.Popen]) -> None:
    for process in reversed(processes):
        process.terminate()
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def measure(args: argparse.Namespace, delays: list[float], depths: list[str]) -> list[dict]:
    prompts = load_prompts(args.prompts, args.limit)
    # (lane index or -1, mode): on through every lane, off once, auto through the last lane.
    runs = [*((i, SPECULATIVE) for i in range(len(depths))), (len(depths) - 1, AUTOREGRESSIVE), (len(depths) - 1, AUTO)]
    results: dict[tuple[float, int, str], list] = {(d, i, m): [] for d in delays for i, m in runs}
    blocks = {(d, i): [0.0, 0.0, 0.0, 0.0] for d in delays for i in range(len(depths))}
    with tempfile.TemporaryDirectory() as folder:
        processes, lanes, proxy = start_services(args, depths, Path(folder))
        try:
            with httpx.Client(timeout=600) as client:
                options = RequestOptions(served_model(client, lanes[0].url), args.max_tokens, 0.0, "off")
                for delay in delays:  # a link's delay is stable: the drafts learn it, as they would
                    proxy.set_delay_ms(delay)
                    for prompt in prompts[: args.warmup]:  # unmeasured, every lane and mode
                        for i, mode in runs:
                            run_one(client, lanes[i].url, prompt, mode, options)
                    for index, prompt in enumerate(prompts):
                        for i, mode in runs:  # modes and depths interleaved per prompt
                            before = lanes[i].blocks() if mode == SPECULATIVE else None
                            results[(delay, i, mode)].append(run_one(client, lanes[i].url, prompt, mode, options, index))
                            if before is not None:
                                after = lanes[i].blocks()
                                for j in range(4):
                                    blocks[(delay, i)][j] += after[j] - before[j]
                    print(f"delay {delay:g} ms done", file=sys.stderr, flush=True)
                    for lane in lanes:
                        if lane.near_metrics_url:  # what the gateway placed by: tokens/s per draft
                            members = client.get(lane.url + "/health").json()["draft"]["members"]
                            speeds = {"near" if m["address"] == lane.near_address else "far":
                                      list(m.get("tokens_per_s", {}).values()) for m in members}
                            print(f"  lane {lane.label}: measured tokens/s by draft {speeds}", file=sys.stderr)
        finally:
            proxy.stop()
            stop(processes)
    rows = []
    for delay in delays:
        off = summarize(results[(delay, len(depths) - 1, AUTOREGRESSIVE)])
        auto = summarize(results[(delay, len(depths) - 1, AUTO)])
        for i, label in enumerate(depths):
            depth, with_near = lane_of(label)
            on = summarize(results[(delay, i, SPECULATIVE)])
            base = summarize(results[(delays[0], i, SPECULATIVE)]).tokens_per_s
            base_off = summarize(results[(delays[0], len(depths) - 1, AUTOREGRESSIVE)]).tokens_per_s
            rounds, held, stale, near_rounds = blocks[(delay, i)]
            rows.append({
                "delay_ms": delay, "lane": label, "depth": depth, "near": with_near, "speculative_tokens_per_s": on.tokens_per_s,
                "autoregressive_tokens_per_s": off.tokens_per_s, "auto_tokens_per_s": auto.tokens_per_s,
                "speedup": on.tokens_per_s / off.tokens_per_s, "speculative_vs_no_delay": on.tokens_per_s / base,
                # The same against the first delay, each over its own delay's `off`: the delays run one
                # after another, and a host whose speed drifts meanwhile moves `off` as much.
                "speedup_vs_no_delay": (on.tokens_per_s / off.tokens_per_s) / (base / base_off),
                "tokens_per_round": on.mean_accepted_length or 0.0,
                "pipelined_share": held / rounds if rounds else 0.0,
                "stale_rate": stale / (held + stale) if held + stale else 0.0,
                "near_share": near_rounds / (rounds + near_rounds) if rounds + near_rounds else 0.0,
            })
    return rows


def print_table(rows: list[dict], depths: list[str], near: bool = False) -> None:
    print("| one-way delay (ms) | lane | on (tok/s) | off (tok/s) | auto, lane "
          f"{depths[-1]} (tok/s) | on / off | on vs 0 ms | on/off vs 0 ms | tokens/round | rounds pipelined | stale rate |"
          + (" rounds on the near draft |" if near else ""))
    print("| --- " * (12 if near else 11) + "|")
    for row in rows:
        pipelined = row["depth"] > 1
        print(f"| {row['delay_ms']:g} | {row['lane']} | {row['speculative_tokens_per_s']:.1f} | "
              f"{row['autoregressive_tokens_per_s']:.1f} | {row['auto_tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
              f"{row['speculative_vs_no_delay']:.2f}x | {row['speedup_vs_no_delay']:.2f}x | {row['tokens_per_round']:.2f} | "
              + (f"{row['pipelined_share']:.0%} | {row['stale_rate']:.0%} |" if pipelined else "- | - |")
              + (f" {row['near_share']:.0%} |" if near else ""))


def plot(rows: list[dict], depths: list[str], path: str) -> None:
    """Speedup over autoregressive decoding against the one-way delay, a line per depth (and auto)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for label in depths:
        mine = [r for r in rows if r["lane"] == label]
        axes.plot([r["delay_ms"] for r in mine], [r["speedup"] for r in mine], marker="o",
                  label=f"on, lane {label}")
    last = [r for r in rows if r["lane"] == depths[-1]]
    axes.plot([r["delay_ms"] for r in last], [r["auto_tokens_per_s"] / r["autoregressive_tokens_per_s"] for r in last],
              marker="s", linestyle="--", label=f"auto, lane {depths[-1]}")
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xlabel("one-way draft-target delay (ms)")
    axes.set_ylabel("tokens/s over autoregressive")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> None:
    delays = [float(d) for d in args.delays_ms.split(",")]
    depths = args.depths.split(",")
    for label in depths:
        lane_of(label)  # a bad lane fails here, before anything starts
    rows = measure(args, delays, depths)
    print_table(rows, depths, any(lane_of(label)[1] for label in depths))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))
    if args.plot:
        plot(rows, depths, args.plot)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-model", default="gemma-3-270m")
    parser.add_argument("--draft-model", default="auto")
    parser.add_argument("--k", type=int, default=0, help="K (0: tandem's default)")
    parser.add_argument("--delays-ms", default="0,1,5,20", help="one-way delays of the draft-target hop")
    parser.add_argument("--depths", default="1,2", help="lanes compared (a draft and gateway each): pipeline depths, "
                        "each maybe with '+near' (a --near-draft beside the target too)")
    parser.add_argument("--prompts", default=None, help="JSONL of {domain, prompt} (default: the bench's set)")
    parser.add_argument("--limit", type=int, default=12, help="prompts (0: all)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured prompts at each delay")
    parser.add_argument("--ready-timeout-s", type=float, default=600)
    parser.add_argument("--near-draft", default="ngram", metavar="DRAFT_MODEL",
                        help="the kind of draft a '+near' lane runs beside the target")
    parser.add_argument("--draft-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for every draft's command line (repeat: --draft-arg=--eagle-k --draft-arg=7)")
    parser.add_argument("--target-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for the target's command line")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw the speedup against the delay")
    main(parser.parse_args())
