"""One streamed chat request, read as the benchmarks need it: when its first text came, the whole
text, and the usage (the request must ask for ``stream_options.include_usage`` to get one)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamedChat:
    seconds: float  # the whole request
    first_token_s: float  # until the first text (the whole request's time when none came)
    text: str
    usage: dict = field(default_factory=dict)


def stream_chat(client: httpx.Client, body: dict) -> StreamedChat:
    """Posts ``body`` (with ``"stream": true``) to /v1/chat/completions and reads its events."""
    started, first, parts, usage = time.perf_counter(), None, [], {}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first if first is not None else time.perf_counter() - started
                    parts.append(choice["delta"]["content"])
    seconds = time.perf_counter() - started
    return StreamedChat(seconds, seconds if first is None else first, "".join(parts), usage)
