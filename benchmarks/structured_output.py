"""Structured output on a running stack: what a JSON schema costs, whether speculation keeps its
speedup under it, and how often the answer is valid JSON with and without it.

Extraction tasks (a short text, a schema of the fields to pull out), greedy chat requests, each of
four lanes in turn per task (``on``/``off`` x free text asked for JSON / ``response_format``
``json_schema``), alternating the lanes' order, streamed: tokens per second of each lane over the
run (whole requests, and decoding alone: the tokens after the first over the time after it, since
an extraction's answer is short beside its prompt), the ratios, how many answers parse and validate
under the schema, and whether the speculative and the autoregressive answers agreed. Each schema's
first request (which compiles it) is timed apart and not counted.

    tandem serve &   # or any stack
    python benchmarks/structured_output.py --url http://127.0.0.1:8000 --max-tokens 96 \
        [--peer-url http://127.0.0.1:8080]   # e.g. llama-server on the same GGUF
"""

from __future__ import annotations

import argparse
import json
import time

import httpx
import jsonschema
from chat_stream import StreamedChat, stream_chat

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


def ask(client: httpx.Client, schema: dict, text: str, speculation: str, constrained: bool,
        max_tokens: int, temperature: float = 0.0) -> StreamedChat:
    fields = ", ".join(schema["properties"])
    body = {
        "messages": [{"role": "user", "content": f"Extract {fields} from the text below and answer with one JSON "
                                                 f"object only.\n\nText: {text}"}],
        "max_tokens": max_tokens, "temperature": temperature, "speculation": speculation, "stream": True,
        "stream_options": {"include_usage": True}, "stream_smoothing": "off",
    }
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "extract", "schema": schema}}
    return stream_chat(client, body)


def tokens(answer: StreamedChat) -> int:
    return answer.usage["completion_tokens"]


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
    parser.add_argument("--peer-url", help="another OpenAI-compatible server (llama-server, say): its json_schema "
                                           "answers to the same tasks, interleaved, as the lane 'peer'")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="1.0 is what the OpenAI SDK sends when a request names none")
    parser.add_argument("--show", action="store_true", help="print each constrained answer")
    parser.add_argument("--settle", type=float, default=6.0,
                        help="seconds for the draft to compile the schemas before the measured requests")
    args = parser.parse_args()
    lanes = [(mode, constrained) for mode in ("on", "off") for constrained in (False, True)]
    clients = {mode: httpx.Client(base_url=args.url, timeout=600) for mode in ("on", "off")}
    if args.peer_url:
        lanes.append(("peer", True))
        # (a connection per request: llama-server closes idle ones, which a reused one would meet mid-request)
        clients["peer"] = httpx.Client(base_url=args.peer_url, timeout=600,
                                       limits=httpx.Limits(max_keepalive_connections=0))
    answers: dict[tuple, list[StreamedChat]] = {lane: [] for lane in lanes}
    # Each schema's first request compiles it (target and draft): a one-time cost, shown apart.
    for name, schema in (("person", PERSON), ("order", ORDER), ("event", EVENT)):
        text = next(text for s, text in TASKS if s is schema)
        first, again = (ask(clients["off"], schema, text, "off", True, 1).seconds for _ in range(2))
        print(f"first request with the {name} schema: {first:.2f} s, the next {again:.2f} s")
        ask(clients["on"], schema, text, "on", True, 8)  # the draft's first: it compiles the schema in the background
        if args.peer_url:
            ask(clients["peer"], schema, text, "off", True, 8)
    time.sleep(args.settle)
    for i, (schema, text) in enumerate(TASKS):
        for mode, constrained in lanes if i % 2 == 0 else reversed(lanes):
            # (a peer ignores tandem's fields: "speculation" and "stream_smoothing")
            answers[mode, constrained].append(
                ask(clients[mode], schema, text, "off" if mode == "peer" else mode, constrained, args.max_tokens,
                    args.temperature))
        if args.show:
            print(f"{text[:50]!r} -> {answers[('on', True)][-1].text}")
    for client in clients.values():
        client.close()
    report(answers)


def report(answers: dict[tuple, list[StreamedChat]]) -> None:
    whole = {lane: sum(map(tokens, got)) / sum(a.seconds for a in got) for lane, got in answers.items()}
    decode = {lane: sum(tokens(a) - 1 for a in got) / sum(a.seconds - a.first_token_s for a in got)
              for lane, got in answers.items()}
    valid_count = {lane: sum(valid(a.text, schema) for a, (schema, _) in zip(got, TASKS))
                   for lane, got in answers.items()}
    for mode in ("on", "off"):
        print(f"{mode:>3}: free text {whole[(mode, False)]:6.1f} tok/s, decoding {decode[(mode, False)]:6.1f} "
              f"({valid_count[(mode, False)]}/{len(TASKS)} valid); json_schema {whole[(mode, True)]:6.1f} tok/s, "
              f"decoding {decode[(mode, True)]:6.1f} ({valid_count[(mode, True)]}/{len(TASKS)} valid)")
    for name, rate in (("whole requests", whole), ("decoding", decode)):
        print(f"on/off, {name}: json_schema {rate[('on', True)] / rate[('off', True)]:.2f}x, free text "
              f"{rate[('on', False)] / rate[('off', False)]:.2f}x; json_schema/free text off "
              f"{rate[('off', True)] / rate[('off', False)]:.2f}x")
    agreed = sum(a.text == b.text for a, b in zip(answers[("on", True)], answers[("off", True)]))
    print(f"speculative and autoregressive json_schema answers identical: {agreed} of {len(TASKS)} (greedy: all)")
    # Per answer, since servers format JSON differently (tandem compactly, others often indented).
    for lane in [lane for lane in answers if lane[1]]:
        got = answers[lane]
        print(f"json_schema answers, {lane[0]}: {sum(a.seconds for a in got) / len(got) * 1e3:.0f} ms each, "
              f"{sum(map(tokens, got)) / len(got):.1f} tokens, {valid_count[lane]}/{len(TASKS)} valid")


if __name__ == "__main__":
    main()
