"""How fast a fleet heals: the time from a target's SIGKILL to the next token of each stream it held.

Starts ``tandem serve --targets N --drafts M`` (every port chosen by the supervisor), runs
``--streams`` concurrent greedy gRPC streams, and once every stream is under way kills the target
that holds the most of them (the gateway's ``/health`` lists each member's sessions). For every
stream it reports the wait from the kill to its next token and its median gap between tokens
before the kill, and its longest pause after the kill (a token already on its way may come first).
Streams are unpaced (``stream_smoothing`` off), so tokens arrive as the gateway gets them. The API
does not say which streams the victim held, so the figure to read is the longest pause over all
streams: an upper bound of the heal time of those that moved. Then it checks
that every stream still produced the tokens of a run without the kill (greedy, so the reference is
the same prompts streamed concurrently beforehand), and where one differs, at which token.

    python benchmarks/failover.py --target-model gemma-3-270m --draft-model ngram --streams 4
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import grpc
import httpx
import psutil

from tandem.fleet import read_ready_block
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

PROMPTS = ["Write a short story about a lighthouse keeper who", "Explain how a bicycle stays upright:",
           "List the planets of the solar system and one fact about each:", "def quicksort(items):",
           "The history of the printing press begins", "Summarise the rules of chess in a paragraph:",
           "Translate to French: The weather is nice today and", "A recipe for bread, step by step:"]


def start(args: argparse.Namespace) -> tuple[subprocess.Popen, dict[str, str]]:
    argv = [sys.executable, "-m", "tandem.cli", "serve", "--target-model", args.target_model, "--draft-model",
            args.draft_model, "--targets", str(args.targets), "--drafts", str(args.drafts), "--http-port", "0",
            "--grpc-port", "0", "--target-port", "0", "--draft-port", "0", "--target-metrics-port", "0",
            "--draft-metrics-port", "0"]
    env = {**os.environ, "TANDEM_TARGET_TIMEOUT_S": str(args.target_timeout_s)}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    lines: list[str] = []
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if "Press Ctrl-C to stop." in line:
            break
    else:
        raise SystemExit("tandem serve exited:\n" + "".join(lines[-50:]))
    threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()  # drain the log
    return process, read_ready_block("".join(lines))


def stream(address: str, prompt: str, max_tokens: int, arrivals: list[tuple[float, int]]) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        request = gateway_pb2.GatewayServiceGenerateRequest(
            prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
            speculation=common_pb2.SPECULATION_MODE_ON,
            # Tokens as the gateway gets them: a paced stream would hide the pause behind its buffer.
            stream_smoothing=gateway_pb2.STREAM_SMOOTHING_OFF)
        ids: list[int] = []
        for chunk in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request, timeout=600):
            ids.extend(chunk.token_ids)
            arrivals.append((time.monotonic(), len(chunk.token_ids)))
    return ids


def pid_on_port(supervisor: int, port: str) -> int:
    for child in psutil.Process(supervisor).children():
        argv = child.cmdline()
        if "--port" in argv and argv[argv.index("--port") + 1] == port:
            return child.pid
    raise LookupError(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-model", default="gemma-3-270m")
    parser.add_argument("--draft-model", default="ngram")
    parser.add_argument("--targets", type=int, default=2)
    parser.add_argument("--drafts", type=int, default=1)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--kill-after-tokens", type=int, default=16)
    parser.add_argument("--target-timeout-s", type=float, default=10.0)
    parser.add_argument("--json", default="", help="write the figures here too")
    args = parser.parse_args()
    process, addresses = start(args)
    gateway, http = addresses["gateway"], f"http://{addresses['http']}"
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.streams)]
    try:
        reference: list[list[int] | None] = [None] * len(prompts)

        def run_reference(i: int) -> None:
            reference[i] = stream(gateway, prompts[i], args.max_tokens, [])

        threads = [threading.Thread(target=run_reference, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        arrivals: list[list[tuple[float, int]]] = [[] for _ in prompts]
        results: list[list[int] | None] = [None] * len(prompts)

        errors: dict[int, str] = {}

        def run(i: int) -> None:
            try:
                results[i] = stream(gateway, prompts[i], args.max_tokens, arrivals[i])
            except grpc.RpcError as exc:
                errors[i] = f"{exc.code().name}: {exc.details()}"

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        while not all(sum(n for _, n in a) >= args.kill_after_tokens for a in arrivals):
            time.sleep(0.01)
        members = httpx.get(f"{http}/health", timeout=10).json()["target"]["members"]
        victim = max(members, key=lambda m: m["sessions"])
        killed_at = time.monotonic()
        os.kill(pid_on_port(process.pid, victim["address"].rsplit(":", 1)[1]), signal.SIGKILL)
        for thread in threads:
            thread.join()
        rows = []
        for i, times in enumerate(arrivals):
            before = [t for t, _ in times if t <= killed_at]
            gaps = [b - a for a, b in zip(before, before[1:])]
            after = [t for t, _ in times if t > killed_at]
            wait = after[0] - killed_at if after else None
            # The longest pause after the kill: the wait, or a later one (a stream that got a
            # token already in flight, then waited for its new target).
            stall = max([wait, *(b - a for a, b in zip(after, after[1:]))]) if after else None
            got, want = results[i] or [], reference[i] or []
            first_difference = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b),
                                    None if len(got) == len(want) else min(len(got), len(want)))
            rows.append({"stream": i, "wait_s": wait, "stall_s": stall,
                         "median_gap_s": statistics.median(gaps) if gaps else None,
                         "tokens_at_kill": sum(n for t, n in times if t <= killed_at),
                         "first_difference": first_difference, "error": errors.get(i)})
        waits = [r["wait_s"] for r in rows if r["wait_s"] is not None]
        stalls = [r["stall_s"] for r in rows if r["stall_s"] is not None]
        summary = {"target_model": args.target_model, "targets": args.targets, "drafts": args.drafts,
                   "streams": args.streams, "victim_sessions": victim["sessions"], "wait_s_max": max(waits),
                   "wait_s_median": statistics.median(waits), "stall_s_max": max(stalls),
                   "all_same_tokens": all(r["first_difference"] is None for r in rows), "rows": rows}
        print(json.dumps(summary, indent=2))
        if args.json:
            with open(args.json, "w") as out:
                json.dump(summary, out, indent=2)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
