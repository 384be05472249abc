"""Predicted outputs (OpenAI's ``prediction``) on a running stack: code edits whose answer repeats most
of the code, with and without the code sent as the prediction.

Per task (a function and a small edit to make), greedy chat requests, ``max_tokens`` long enough for
the whole function, three lanes in turn, alternating their order: ``on`` with the prediction, ``on``
without it (the default drafts, prompt lookup included, which also copies from the code in the
prompt), and ``off``. Reported: tokens per second of each lane, drafts accepted per round, the
prediction's accepted and rejected tokens (``usage.completion_tokens_details``), and whether the
three answers were the same text (greedy: they must be).

    tandem serve &   # or any stack
    python benchmarks/predicted_outputs.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import time

import httpx

CODE = [
    '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def __len__(self):
        return len(self.items)
''',
    '''def read_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings
''',
]
EDITS = ["Rename the variable total to acc.", "Add a docstring to the first definition.",
         "Change every double quote to a single quote."]


def ask(client: httpx.Client, code: str, edit: str, speculation: str, predicted: bool, max_tokens: int) -> tuple:
    body = {"messages": [{"role": "user", "content": f"{edit} Answer with the whole code only.\n\n{code}"}],
            "max_tokens": max_tokens, "temperature": 0, "speculation": speculation}
    if predicted:
        body["prediction"] = {"type": "content", "content": code}
    started = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    done = response.json()
    return time.perf_counter() - started, done["usage"], done["choices"][0]["message"]["content"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    lanes = [("on", True), ("on", False), ("off", False)]
    seconds = dict.fromkeys(lanes, 0.0)
    tokens = dict.fromkeys(lanes, 0)
    rounds = dict.fromkeys(lanes, 0)
    accepted = dict.fromkeys(lanes, 0)
    predicted = {"accepted": 0, "rejected": 0}
    same = total = 0
    with httpx.Client(base_url=args.url, timeout=600) as client:
        ask(client, CODE[0], EDITS[0], "on", True, 8)  # warm-up, unmeasured
        for i, (code, edit) in enumerate((c, e) for c in CODE for e in EDITS):
            texts = {}
            for lane in lanes if i % 2 == 0 else reversed(lanes):
                took, usage, texts[lane] = ask(client, code, edit, *lane, args.max_tokens)
                seconds[lane] += took
                tokens[lane] += usage["completion_tokens"]
                rounds[lane] += usage["speculative_decoding"]["rounds"]
                accepted[lane] += usage["speculative_decoding"]["accepted_tokens"]
                if lane[1]:
                    details = usage["completion_tokens_details"]
                    predicted["accepted"] += details["accepted_prediction_tokens"]
                    predicted["rejected"] += details["rejected_prediction_tokens"]
            same += len(set(texts.values())) == 1
            total += 1
    rate = {lane: tokens[lane] / seconds[lane] for lane in lanes}
    for lane in lanes:
        name = f"{lane[0]}{' + prediction' if lane[1] else ''}"
        per_round = f", {accepted[lane] / rounds[lane]:.2f} accepted a round" if rounds[lane] else ""
        print(f"{name:>15}: {rate[lane]:6.1f} tok/s ({rate[lane] / rate[('off', False)]:.2f}x off){per_round}")
    print(f"prediction: {rate[('on', True)] / rate[('on', False)]:.2f}x over on without it; its tokens accepted "
          f"{predicted['accepted']}, rejected {predicted['rejected']}; the three answers the same in {same} of {total}")


if __name__ == "__main__":
    main()
