"""What the target's prefix cache does for a chat: the time to first token of each turn of one
conversation, on stacks given side by side (e.g. one started with ``TANDEM_PREFIX_CACHE=false``),
the turns interleaved between them.

The conversation opens with a long system message (the first ``--system-chars`` characters of the
README), then asks the bench prompts one per turn, each request carrying the whole conversation so
far with the answers the same stack gave, as a chat frontend sends it. Per turn and stack: the
prompt's tokens, how many the target took from its cache (usage ``prompt_tokens_details``), and the
time to the first streamed token; last, in how many turns every stack gave the same answer
(greedy: a cached prefix changes no token).

    python benchmarks/prefix_cache.py --url cached=http://127.0.0.1:8000 --url whole=http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import httpx
from chat_stream import stream_chat

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT.parent / "shared" / "bench" / "prompts.jsonl"


def turn(client: httpx.Client, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """(seconds to the first token, the answer, the usage) of one streamed chat request."""
    done = stream_chat(client, {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}})
    return done.first_token_s, done.text, done.usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", action="append", required=True, help="LABEL=URL of a running stack (repeatable)")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--system-chars", type=int, default=4000)
    args = parser.parse_args()
    stacks = dict(item.split("=", 1) for item in args.url)
    system = (ROOT / "README.md").read_text()[: args.system_chars]
    questions = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    conversations = {label: [{"role": "system", "content": system}] for label in stacks}
    ttft: dict[str, list[float]] = {label: [] for label in stacks}
    clients = {label: httpx.Client(base_url=url, timeout=600) for label, url in stacks.items()}
    same = 0
    print(f"{'turn':>4} " + " ".join(f"{label + ': prompt / cached / TTFT':>40}" for label in stacks))
    for t in range(args.turns):
        row, answers = [], set()
        for label in stacks if t % 2 == 0 else reversed(list(stacks)):
            messages = conversations[label] + [{"role": "user", "content": questions[t % len(questions)]}]
            seconds, answer, usage = turn(clients[label], messages, args.max_tokens)
            conversations[label] = messages + [{"role": "assistant", "content": answer}]
            answers.add(answer)
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            ttft[label].append(seconds)
            row.append((label, f"{usage.get('prompt_tokens', 0):>6} / {cached:>6} / {seconds * 1000:7.0f} ms"))
        print(f"{t:>4} " + " ".join(f"{text:>40}" for _, text in sorted(row, key=lambda r: list(stacks).index(r[0]))))
        same += len(answers) == 1
    for label in stacks:
        later = ttft[label][1:] or ttft[label]
        print(f"{label}: median TTFT after the first turn {statistics.median(later) * 1000:.0f} ms")
    print(f"turns whose answers were the same on every stack: {same} of {args.turns}")
    for client in clients.values():
        client.close()


if __name__ == "__main__":
    main()
