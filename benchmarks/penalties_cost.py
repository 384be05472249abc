"""What presence and frequency penalties cost, and that speculation keeps them: a running stack's
completions with and without them, speculative and autoregressive, interleaved per prompt.

Per prompt of the bench set, greedy, ``ignore_eos``, each of four lanes in turn (``on``/``off`` x
without/with ``frequency_penalty: F``, ``presence_penalty: F / 2``), alternating their order: tokens
per second of each lane over the run, their ratios, and in how many prompts the speculative and the
autoregressive answers under the penalties were the same text.

    tandem serve &   # or any stack
    python benchmarks/penalties_cost.py --url http://127.0.0.1:8000 --limit 12 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "prompts.jsonl"


def complete(client: httpx.Client, prompt: str, speculation: str, penalty: float, max_tokens: int) -> tuple:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "speculation": speculation,
            "ignore_eos": True, "frequency_penalty": penalty, "presence_penalty": penalty / 2}
    started = time.perf_counter()
    response = client.post("/v1/completions", json=body)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    done = response.json()
    return seconds, done["usage"]["completion_tokens"], done["choices"][0]["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--prompts", type=Path, default=PROMPTS)
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--penalty", type=float, default=1.0, help="frequency_penalty (presence_penalty: half)")
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = prompts[: args.limit]
    lanes = [(mode, penalty) for mode in ("on", "off") for penalty in (0.0, args.penalty)]
    seconds = {lane: 0.0 for lane in lanes}
    tokens = {lane: 0 for lane in lanes}
    same = 0
    with httpx.Client(base_url=args.url, timeout=600) as client:
        complete(client, prompts[0], "on", args.penalty, 8)  # warm-up, unmeasured
        for i, prompt in enumerate(prompts):
            texts = {}
            for lane in lanes if i % 2 == 0 else reversed(lanes):
                took, n, texts[lane] = complete(client, prompt, *lane, args.max_tokens)
                seconds[lane] += took
                tokens[lane] += n
            same += texts[("on", args.penalty)] == texts[("off", args.penalty)]
    rate = {lane: tokens[lane] / seconds[lane] for lane in lanes}
    for mode in ("on", "off"):
        without, with_ = rate[(mode, 0.0)], rate[(mode, args.penalty)]
        print(f"{mode:>3}: {without:6.1f} tok/s without, {with_:6.1f} with penalties ({with_ / without:.2f}x)")
    print(f"on/off with penalties: {rate[('on', args.penalty)] / rate[('off', args.penalty)]:.2f}x; "
          f"without: {rate[('on', 0.0)] / rate[('off', 0.0)]:.2f}x")
    print(f"speculative and autoregressive answers under the penalties the same: {same} of {len(prompts)}")


if __name__ == "__main__":
    main()
