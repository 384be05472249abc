"""Speculative decoding across a slow draft-target hop: tokens/s against the one-way delay.

Starts target, draft and gateway as ``tandem serve`` would (its own child commands, on free
ports), but points the draft at a delaying TCP proxy in front of the target
(``tandem.tools.bench.delay_proxy``), so every block and verdict crosses a link of the chosen
one-way latency. The gateway reaches the target directly: autoregressive decoding never crosses
the hop. One stack serves every delay: the proxy's delay changes between requests, and each prompt
is sent at every delay in turn, speculative and autoregressive, interleaved. Reported per delay:
the tokens/s (the bench's definition: completion tokens over request time) of speculation on, off
and ``auto`` (the default, which falls back to autoregressive decoding where speculation does not
pay), the speedup of on over off,
speculative tokens/s relative to delay 0, and the mean committed tokens per round.

    python benchmarks/hop_delay.py --target-model gemma-3-270m --delays-ms 0,1,5,20 --limit 12
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tandem.config import ServeSettings
from tandem.supervisor import child_commands, is_serving
from tandem.tools.bench.client import AUTO, AUTOREGRESSIVE, SPECULATIVE, RequestOptions, run_one, served_model
from tandem.tools.bench.delay_proxy import DelayProxy
from tandem.tools.bench.metrics import summarize
from tandem.tools.bench.prompts import load_prompts
from tandem.tools.bench.stack import free_port

# Speculation forced on, off, and the gateway's default (which falls back where speculation does not pay).
MODES = (SPECULATIVE, AUTOREGRESSIVE, AUTO)


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


def start_services(args: argparse.Namespace, log_dir: Path) -> tuple[list[subprocess.Popen], ServeSettings, ProxyThread]:
    settings = ServeSettings(
        target_model=args.target_model, draft_model=args.draft_model, http_port=free_port(), grpc_port=free_port(),
        draft_port=free_port(), target_port=free_port(), draft_metrics_port=0, target_metrics_port=0,
        log_level="warning", stream_smoothing="off", **({"num_speculative_tokens": args.k} if args.k else {}),
    )
    proxy = ProxyThread(f"127.0.0.1:{settings.target_port}")
    processes = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") or k == "TANDEM_CACHE_DIR"}
    for child in child_commands(settings):
        argv = list(child.argv)
        if child.name == "draft":  # the draft reaches the target through the proxy
            argv[argv.index("--target-address") + 1] = proxy.proxy.address
            argv += args.draft_arg
        with open(log_dir / f"{child.name}.log", "w") as log:
            processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                              env={**env, **child.env}, start_new_session=True))
        deadline = time.monotonic() + args.ready_timeout_s
        while not is_serving(child.health_address, timeout=1.0):
            if processes[-1].poll() is not None or time.monotonic() > deadline:
                stop(processes)
                raise SystemExit(f"{child.name} did not start: {(log_dir / f'{child.name}.log').read_text()[-2000:]}")
            time.sleep(0.5)
    return processes, settings, proxy


def stop(processes: list[subprocess.Popen]) -> None:
    for process in reversed(processes):
        process.terminate()
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def main(args: argparse.Namespace) -> None:
    delays = [float(d) for d in args.delays_ms.split(",")]
    prompts = load_prompts(args.prompts, args.limit)
    with tempfile.TemporaryDirectory() as folder:
        processes, settings, proxy = start_services(args, Path(folder))
        try:
            url = f"http://127.0.0.1:{settings.http_port}"
            results: dict[tuple[float, str], list] = {(d, m): [] for d in delays for m in MODES}
            with httpx.Client(timeout=600) as client:
                options = RequestOptions(served_model(client, url), args.max_tokens, 0.0, "off")
                for prompt in prompts[: args.warmup]:  # warm up (every mode, no delay)
                    for mode in MODES:
                        run_one(client, url, prompt, mode, options)
                for index, prompt in enumerate(prompts):
                    for delay in delays:
                        proxy.set_delay_ms(delay)
                        for mode in MODES:
                            results[(delay, mode)].append(run_one(client, url, prompt, mode, options, index))
                    print(f"prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
        finally:
            proxy.stop()
            stop(processes)
    rows = []
    base = summarize(results[(delays[0], SPECULATIVE)]).tokens_per_s
    print(f"{'one-way delay (ms)':>18} {'spec tok/s':>11} {'AR tok/s':>9} {'auto tok/s':>11} {'speedup':>8} "
          f"{'spec vs 0 ms':>13} {'tokens/round':>13}")
    for delay in delays:
        spec, ar, auto = (summarize(results[(delay, mode)]) for mode in MODES)
        per_round = spec.mean_accepted_length or 0.0
        rows.append({"delay_ms": delay, "speculative_tokens_per_s": spec.tokens_per_s,
                     "autoregressive_tokens_per_s": ar.tokens_per_s, "auto_tokens_per_s": auto.tokens_per_s,
                     "speedup": spec.tokens_per_s / ar.tokens_per_s,
                     "speculative_vs_no_delay": spec.tokens_per_s / base, "tokens_per_round": per_round})
        print(f"{delay:>18g} {spec.tokens_per_s:>11.1f} {ar.tokens_per_s:>9.1f} {auto.tokens_per_s:>11.1f} "
              f"{rows[-1]['speedup']:>7.2f}x {rows[-1]['speculative_vs_no_delay']:>12.2f}x {per_round:>13.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-model", default="gemma-3-270m")
    parser.add_argument("--draft-model", default="auto")
    parser.add_argument("--k", type=int, default=0, help="K (0: tandem's default)")
    parser.add_argument("--delays-ms", default="0,1,5,20", help="one-way delays of the draft-target hop")
    parser.add_argument("--prompts", default=None, help="JSONL of {domain, prompt} (default: the bench's set)")
    parser.add_argument("--limit", type=int, default=12, help="prompts (0: all)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--ready-timeout-s", type=float, default=600)
    parser.add_argument("--draft-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for the draft's command line (repeat: --draft-arg=--eagle-k --draft-arg=7)")
    parser.add_argument("--json", default=None, help="write the rows here")
    main(parser.parse_args())
