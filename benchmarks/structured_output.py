"""Structured output on a running stack: what a JSON schema costs, whether speculation keeps its
speedup under it, and how often the answer is valid JSON with and without it.

Extraction tasks (a short text, a schema of the fields to pull out), greedy chat requests, each of
four lanes in turn per task (``on``/``off`` x free text asked for JSON / ``response_format``
``json_schema``), alternating the lanes' order: tokens per second of each lane over the run, the
ratios, how many answers parse and validate under the schema, and whether the speculative and the
autoregressive answers agreed.

    tandem serve &   # or any stack
    python benchmarks/structured_output.py --url http://127.0.0.1:8000 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import time

import httpx
import jsonschema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "product": {"type": "string", "maxLength": 40},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
        "express": {"type": "boolean"},
    },
    "required": ["product", "quantity", "express"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 6},
    },
    "required": ["title", "day", "attendees"],
    "additionalProperties": False,
}
TASKS = [
    (PERSON, "Maria Lopez, 34, moved to Barcelona last spring to work as an architect."),
    (PERSON, "At 71, retired teacher John Carter still volunteers at the library in Leeds."),
    (PERSON, "Our new intern is Kenji Sato; he is 22 and lives in Osaka."),
    (PERSON, "Dr. Amara Okafor (45) leads the cardiology unit of a hospital in Lagos."),
    (ORDER, "Please send 12 boxes of printer paper, and we need them by tomorrow, so use express shipping."),
    (ORDER, "I'd like to order 3 ergonomic chairs. No rush, standard delivery is fine."),
    (ORDER, "Add 250 USB-C cables to the order; regular shipping."),
    (ORDER, "One espresso machine, please, delivered express."),
    (EVENT, "Team retrospective on Friday with Alice, Bob and Chen."),
    (EVENT, "The quarterly budget review is on Tuesday; Dana and Eli will attend."),
    (EVENT, "Sunday brunch with Grandma, Uncle Joe and the twins."),
    (EVENT, "Wednesday: product launch rehearsal with the marketing team (Priya, Tom)."),
]


def ask(client: httpx.Client, schema: dict, text: str, speculation: str, constrained: bool, max_tokens: int) -> tuple:
    fields = ", ".join(schema["properties"])
    body = {
        "messages": [{"role": "user", "content": f"Extract {fields} from the text below and answer with one JSON "
                                                 f"object only.\n\nText: {text}"}],
        "max_tokens": max_tokens, "temperature": 0, "speculation": speculation,
    }
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "extract", "schema": schema}}
    started = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    done = response.json()
    content = done["choices"][0]["message"]["content"]
    return seconds, done["usage"]["completion_tokens"], content, valid(content, schema)


def valid(content: str, schema: dict) -> bool:
    """Whether the answer is one JSON value the schema accepts (free text may wrap it in a code
    fence, which is taken off first: that much a client would do)."""
    text = content.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--show", action="store_true", help="print each constrained answer")
    args = parser.parse_args()
    lanes = [(mode, constrained) for mode in ("on", "off") for constrained in (False, True)]
    seconds = {lane: 0.0 for lane in lanes}
    tokens = {lane: 0 for lane in lanes}
    valid_count = {lane: 0 for lane in lanes}
    agreed = 0
    with httpx.Client(base_url=args.url, timeout=600) as client:
        ask(client, PERSON, TASKS[0][1], "on", True, 8)  # warm-up (the grammar compiler), unmeasured
        for i, (schema, text) in enumerate(TASKS):
            answers = {}
            for lane in lanes if i % 2 == 0 else reversed(lanes):
                took, n, content, ok = ask(client, schema, text, *lane, args.max_tokens)
                seconds[lane] += took
                tokens[lane] += n
                valid_count[lane] += ok
                answers[lane] = content
            agreed += answers[("on", True)] == answers[("off", True)]
            if args.show:
                print(f"{text[:50]!r} -> {answers[('on', True)]}")
    rate = {lane: tokens[lane] / seconds[lane] for lane in lanes}
    for mode in ("on", "off"):
        free, schema = rate[(mode, False)], rate[(mode, True)]
        print(f"{mode:>3}: free text {free:6.1f} tok/s ({valid_count[(mode, False)]}/{len(TASKS)} valid), "
              f"json_schema {schema:6.1f} tok/s ({valid_count[(mode, True)]}/{len(TASKS)} valid); "
              f"schema/free {schema / free:.2f}x")
    print(f"on/off with json_schema: {rate[('on', True)] / rate[('off', True)]:.2f}x; "
          f"free text: {rate[('on', False)] / rate[('off', False)]:.2f}x")
    print(f"speculative and autoregressive json_schema answers identical: {agreed} of {len(TASKS)}")


if __name__ == "__main__":
    main()
