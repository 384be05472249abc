"""What presence and frequency penalties (or a repetition penalty, a logit bias, a min_tokens floor,
min_p, typical_p, bad words) cost, and that speculation keeps them: a running stack's completions with and without them,
speculative and autoregressive, interleaved per prompt.

Per prompt of the bench set, greedy, ``ignore_eos``, each of four lanes in turn (``on``/``off`` x
without/with ``frequency_penalty: F``, ``presence_penalty: F / 2``), alternating their order: tokens
per second of each lane over the run, their ratios, and in how many prompts the speculative and the
autoregressive answers under the penalties were the same text. ``--ban WORD ...`` measures
``logit_bias`` instead: -100 on each token of those words (ids from the server's ``/tokenize``);
``--repetition R`` the ``repetition_penalty`` R; ``--floor`` ``min_tokens`` at ``max_tokens`` without
``ignore_eos`` (the end-of-sequence token held back on every row); ``--min-p P`` ``min_p`` P and
``--typical-p P`` ``typical_p`` P, which only sampled requests feel: with ``--temperature T`` every
lane samples (prompt i seeded i); ``--bad-words WORD ...`` vLLM's ``bad_words``.

    tandem serve &   # or any stack
    python benchmarks/penalties_cost.py --url http://127.0.0.1:8000 --limit 12 --max-tokens 64
    python benchmarks/penalties_cost.py --ban " the" " a" "," --limit 12
    python benchmarks/penalties_cost.py --repetition 1.1 --limit 12
    python benchmarks/penalties_cost.py --min-p 0.05 --temperature 1 --limit 12
    python benchmarks/penalties_cost.py --typical-p 0.9 --temperature 1 --limit 12
    python benchmarks/penalties_cost.py --bad-words the and is --limit 12
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "prompts.jsonl"


def complete(client: httpx.Client, prompt: str, speculation: str, shaped: dict, max_tokens: int,
             temperature: float = 0.0, seed: int = 0) -> tuple:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "speculation": speculation,
            "ignore_eos": True, **shaped}
    if temperature:
        body["seed"] = seed
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
    parser.add_argument("--ban", nargs="+", metavar="WORD", help="measure logit_bias -100 on these words' tokens")
    parser.add_argument("--repetition", type=float, help="measure this repetition_penalty instead")
    parser.add_argument("--floor", action="store_true", help="measure min_tokens = --max-tokens (EOS held back)")
    parser.add_argument("--min-p", type=float, help="measure this min_p instead (with --temperature)")
    parser.add_argument("--typical-p", type=float, help="measure this typical_p instead (with --temperature)")
    parser.add_argument("--bad-words", nargs="+", metavar="WORD", help="measure bad_words of these words instead")
    parser.add_argument("--temperature", type=float, default=0.0, help="every lane's temperature (default 0: greedy)")
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = prompts[: args.limit]
    lanes = [(mode, shaped) for mode in ("on", "off") for shaped in (False, True)]
    seconds = {lane: 0.0 for lane in lanes}
    tokens = {lane: 0 for lane in lanes}
    same = 0
    with httpx.Client(base_url=args.url, timeout=600) as client:
        what, shaping = "penalties", {"frequency_penalty": args.penalty, "presence_penalty": args.penalty / 2}
        if args.ban:
            ids = set()
            for word in args.ban:
                answer = client.post("/tokenize", json={"prompt": word, "add_special_tokens": False})
                ids.update(answer.raise_for_status().json()["tokens"])
            what, shaping = f"logit_bias ({len(ids)} tokens banned)", {"logit_bias": {str(t): -100 for t in ids}}
        elif args.repetition is not None:
            what, shaping = f"repetition_penalty {args.repetition:g}", {"repetition_penalty": args.repetition}
        elif args.floor:
            what, shaping = "min_tokens at max_tokens", {"min_tokens": args.max_tokens, "ignore_eos": False}
        elif args.min_p is not None:
            what, shaping = f"min_p {args.min_p:g}", {"min_p": args.min_p}
        elif args.typical_p is not None:
            what, shaping = f"typical_p {args.typical_p:g}", {"typical_p": args.typical_p}
        elif args.bad_words:
            what, shaping = f"bad_words ({len(args.bad_words)} words)", {"bad_words": args.bad_words}
        bodies = {False: {}, True: shaping}
        complete(client, prompts[0], "on", shaping, args.max_tokens if args.floor else 8)  # warm-up, unmeasured
        for i, prompt in enumerate(prompts):
            texts = {}
            for lane in lanes if i % 2 == 0 else reversed(lanes):
                took, n, texts[lane] = complete(client, prompt, lane[0], bodies[lane[1]], args.max_tokens,
                                                args.temperature, seed=i)
                seconds[lane] += took
                tokens[lane] += n
            same += texts[("on", True)] == texts[("off", True)]
    rate = {lane: tokens[lane] / seconds[lane] for lane in lanes}
    for mode in ("on", "off"):
        without, with_ = rate[(mode, False)], rate[(mode, True)]
        print(f"{mode:>3}: {without:6.1f} tok/s without, {with_:6.1f} with {what} ({with_ / without:.2f}x)")
    print(f"on/off with {what}: {rate[('on', True)] / rate[('off', True)]:.2f}x; "
          f"without: {rate[('on', False)] / rate[('off', False)]:.2f}x")
    if not args.temperature:  # sampled answers are the same in distribution, not text for text
        print(f"speculative and autoregressive answers under {what} the same: {same} of {len(prompts)}")


if __name__ == "__main__":
    main()
