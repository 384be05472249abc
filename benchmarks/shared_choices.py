"""Requests for several choices (``n``) of one long prompt: whole-request time and time to the first
token on running stacks, interleaved per prompt.

Each prompt is new to the servers (a unique opening, then a shared-looking body of about
``--prompt-tokens`` tokens), so no earlier request's cache serves it; only its own choices can
share it. Completions, greedy choices apart by seed at temperature 1, ``max_tokens`` short, so the
prompt's prefill is most of the work.

    python benchmarks/shared_choices.py --url new=http://127.0.0.1:8000 --url old=http://127.0.0.1:8100 --n 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import httpx

WORDS = ("the river carried cold light past quiet towns while engineers measured each bridge and wrote their "
         "numbers in small careful books that nobody else would read until the spring floods came").split()


RUN = time.time_ns()  # prompts of one run are new to servers that served earlier runs


def prompt(index: int, words: int) -> str:
    rng = random.Random(f"{RUN}-{index}")
    opening = f"Report {index} ({rng.randrange(10**9)}):"
    return opening + " " + " ".join(rng.choice(WORDS) for _ in range(words))


def ask(client: httpx.Client, text: str, n: int, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first streamed token, seconds for the whole request)."""
    body = {"prompt": text, "n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": 7, "stream": True}
    started, first = time.perf_counter(), None
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and '"text":"' in line and '"text":""' not in line:
                first = time.perf_counter() - started
    whole = time.perf_counter() - started
    return (whole if first is None else first), whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", action="append", required=True, help="NAME=URL, two or more")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=600, help="about this many words of prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    servers = dict(entry.split("=", 1) for entry in args.url)
    clients = {name: httpx.Client(base_url=url, timeout=600) for name, url in servers.items()}
    names = list(servers)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for name in names:
        ask(clients[name], prompt(-1, 32), args.n, 2)  # warm-up, unmeasured
    for i in range(args.prompts):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(ask(clients[name], prompt(i * 100 + names.index(name), args.prompt_tokens), args.n,
                                   args.max_tokens))
    for name in names:
        first = statistics.median(t[0] for t in times[name])
        whole = statistics.median(t[1] for t in times[name])
        print(f"{name:>8}: n={args.n}, time to first token median {first * 1e3:.0f} ms, "
              f"whole request {whole * 1e3:.0f} ms")
    for client in clients.values():
        client.close()


if __name__ == "__main__":
    main()
