"""What asking for log-probabilities costs, and that speculation keeps them: a running stack's
completions with and without ``logprobs``, speculative and autoregressive, interleaved per prompt.

Per prompt of the bench set, greedy, each of four lanes in turn (``on``/``off`` x without/with
``logprobs: N``): tokens per second of each lane over the run, their ratios, and whether the
speculative and the autoregressive answers agreed token for token and in every log-probability
(within ``--tolerance``: the two decode through passes of different widths).

    tandem serve &   # or any stack
    python benchmarks/logprobs_cost.py --url http://127.0.0.1:8000 --limit 12 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "prompts.jsonl"


def complete(client: httpx.Client, prompt: str, speculation: str, logprobs: int | None, max_tokens: int) -> tuple:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "speculation": speculation,
            "ignore_eos": True}
    if logprobs is not None:
        body["logprobs"] = logprobs
    started = time.perf_counter()
    response = client.post("/v1/completions", json=body)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return seconds, response.json()["usage"]["completion_tokens"], choice["text"], choice["logprobs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--prompts", type=Path, default=PROMPTS)
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--logprobs", type=int, default=5, help="alternatives asked for (the legacy API's 0..20)")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = prompts[: args.limit]
    lanes = [(mode, lp) for mode in ("on", "off") for lp in (None, args.logprobs)]
    seconds = {lane: 0.0 for lane in lanes}
    tokens = {lane: 0 for lane in lanes}
    agreed, largest = 0, 0.0
    with httpx.Client(base_url=args.url, timeout=600) as client:
        complete(client, prompts[0], "on", args.logprobs, 8)  # warm-up, unmeasured
        for i, prompt in enumerate(prompts):
            answers = {}
            for lane in lanes if i % 2 == 0 else reversed(lanes):
                took, n, text, logprobs = complete(client, prompt, *lane, args.max_tokens)
                seconds[lane] += took
                tokens[lane] += n
                answers[lane] = (text, logprobs)
            spec, plain = answers[("on", args.logprobs)], answers[("off", args.logprobs)]
            gaps = [abs(a - b) for a, b in zip(spec[1]["token_logprobs"], plain[1]["token_logprobs"])]
            largest = max([largest, *gaps])
            agreed += spec[1]["tokens"] == plain[1]["tokens"] and max(gaps, default=0.0) <= args.tolerance
    rate = {lane: tokens[lane] / seconds[lane] for lane in lanes}
    for mode in ("on", "off"):
        without, with_ = rate[(mode, None)], rate[(mode, args.logprobs)]
        print(f"{mode:>3}: {without:6.1f} tok/s without, {with_:6.1f} with logprobs={args.logprobs} "
              f"({with_ / without:.2f}x)")
    print(f"on/off with logprobs: {rate[('on', args.logprobs)] / rate[('off', args.logprobs)]:.2f}x; "
          f"without: {rate[('on', None)] / rate[('off', None)]:.2f}x")
    print(f"speculative and autoregressive answers agreeing in tokens and log-probabilities: {agreed} of "
          f"{len(prompts)} (largest difference {largest:.2e})")


if __name__ == "__main__":
    main()
