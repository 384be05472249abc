"""Tool calls on a running stack: what they cost, whether speculation keeps its speedup under them,
and how often the model picks the function a task needs.

Agent-style requests (one user message, five tools), greedy, ``tool_choice: "required"`` (or
``--tool-choice auto``) with ``parallel_tool_calls: false``, each lane (``on``/``off``) in turn per
task, alternating the order: seconds per answer, tokens per second, how many calls are valid under
their function's schema and name the expected function, and whether the speculative and the
autoregressive calls agree. The first request (which compiles the tools' schema) is timed apart
and not counted.

    tandem serve &   # or any stack
    python benchmarks/tool_calls.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import time

import httpx
import jsonschema


def function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TEXT = {"type": "string", "maxLength": 40}
TOOLS = [
    function("get_weather", "The weather now in a city", {"city": TEXT, "unit": {"enum": ["celsius", "fahrenheit"]}},
             ["city", "unit"]),
    function("convert_currency", "Convert an amount of money", {
        "amount": {"type": "number", "minimum": 0, "maximum": 1e9}, "from": {"enum": ["USD", "EUR", "GBP", "JPY"]},
        "to": {"enum": ["USD", "EUR", "GBP", "JPY"]}}, ["amount", "from", "to"]),
    function("set_timer", "Start a countdown timer", {"minutes": {"type": "integer", "minimum": 1, "maximum": 1440},
                                                      "label": TEXT}, ["minutes", "label"]),
    function("send_email", "Send a short email", {"to": TEXT, "subject": {"type": "string", "maxLength": 60}},
             ["to", "subject"]),
    function("search_web", "Search the web", {"query": {"type": "string", "maxLength": 60}}, ["query"]),
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
TASKS = [
    ("get_weather", "What's the weather like in Lisbon right now? Use celsius."),
    ("get_weather", "Is it hot in Phoenix today? Tell me in fahrenheit."),
    ("convert_currency", "How much is 250 euros in US dollars?"),
    ("convert_currency", "Convert 10000 yen to pounds."),
    ("set_timer", "Set a timer for 12 minutes for the pasta."),
    ("set_timer", "Remind me in 45 minutes to call mom."),
    ("send_email", "Email bob@example.com that the meeting moved to Friday."),
    ("send_email", "Send an email to ana@corp.io with the subject 'Quarterly report'."),
    ("search_web", "Find recent news about the James Webb telescope."),
    ("search_web", "Look up the population of Nairobi."),
]


def ask(client: httpx.Client, task: str, speculation: str, max_tokens: int, choice: str = "required"
        ) -> tuple[float, dict]:
    body = {"messages": [{"role": "user", "content": task}], "tools": TOOLS, "tool_choice": choice,
            "parallel_tool_calls": False, "max_tokens": max_tokens, "temperature": 0, "speculation": speculation}
    started = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return time.perf_counter() - started, response.json()


def call_of(answer: dict) -> tuple[str, dict] | None:
    calls = answer["choices"][0]["message"].get("tool_calls") or []
    if len(calls) != 1:
        return None
    name, arguments = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(arguments, SCHEMAS[name])
    return name, arguments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--show", action="store_true", help="print each speculative call")
    parser.add_argument("--tool-choice", default="required", choices=["required", "auto"],
                        help="auto: the model may answer in text (counted as no call)")
    parser.add_argument("--settle", type=float, default=6.0,
                        help="seconds for the draft to compile the schema before the measured requests")
    args = parser.parse_args()
    seconds = {"on": [], "off": []}
    tokens = {"on": 0, "off": 0}
    calls: dict[str, list] = {"on": [], "off": []}
    with httpx.Client(base_url=args.url, timeout=600) as client:
        first, again = (ask(client, TASKS[0][1], "off", 1)[0] for _ in range(2))
        print(f"first request with these tools: {first:.2f} s, the next {again:.2f} s")
        ask(client, TASKS[0][1], "on", 8)  # the draft's first: it compiles the schema in the background
        time.sleep(args.settle)
        for i, (_, task) in enumerate(TASKS):
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                took, answer = ask(client, task, mode, args.max_tokens, args.tool_choice)
                seconds[mode].append(took)
                tokens[mode] += answer["usage"]["completion_tokens"]
                calls[mode].append(call_of(answer))
            if args.show:
                print(f"{task[:50]!r} -> {calls['on'][-1]}")
    for mode in ("on", "off"):
        right = sum(c is not None and c[0] == expected for c, (expected, _) in zip(calls[mode], TASKS))
        valid = sum(c is not None for c in calls[mode])
        print(f"{mode:>3}: {sum(seconds[mode]) / len(TASKS) * 1e3:.0f} ms a call, "
              f"{tokens[mode] / sum(seconds[mode]):.1f} tok/s, {valid}/{len(TASKS)} valid, "
              f"{right}/{len(TASKS)} the expected function")
    print(f"on/off: {sum(seconds['off']) / sum(seconds['on']):.2f}x; speculative and autoregressive calls "
          f"identical: {sum(a == b for a, b in zip(calls['on'], calls['off']))} of {len(TASKS)}")


if __name__ == "__main__":
    main()
