"""One streamed completion against the gateway, timed chunk by chunk.

Speculation is forced per request with the ``speculation`` extension field (``"on"``/``"off"``), so
one gateway serves both modes of the same run; the final usage chunk carries the speculative
counters (rounds, drafted and accepted tokens) the report turns into acceptance figures.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from itertools import pairwise

import httpx

from tandem.bench.prompts import Prompt

SPECULATIVE = "speculative"
AUTOREGRESSIVE = "autoregressive"
PEER = "peer"
MODES = (SPECULATIVE, AUTOREGRESSIVE)
_SPECULATION = {SPECULATIVE: "on", AUTOREGRESSIVE: "off"}


@dataclass
class RequestResult:
    """What one request measured. Times are seconds; ``started_at`` is on the perf_counter clock."""

    domain: str
    mode: str
    completion_tokens: int
    ttft_s: float
    e2e_s: float
    chunk_gaps_s: list[float]
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    text: str = ""
    prompt_index: int = 0
    started_at: float = 0.0
    queued_s: float = 0.0  # open-loop only: how long an arrival waited for a free slot
    error: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RequestOptions:
    """The request fields every mode shares (same prompts, same max tokens, greedy)."""

    model: str
    max_tokens: int
    temperature: float = 0.0
    stream_smoothing: str | None = None  # None: the gateway's --stream-smoothing
    num_speculative_tokens: int | None = None  # None: the gateway's K


def request_body(prompt: Prompt, mode: str, options: RequestOptions) -> dict:
    body = {
        "model": options.model,
        "prompt": prompt.prompt,
        "max_tokens": options.max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculation": _SPECULATION[mode],
    }
    if options.stream_smoothing is not None:
        body["stream_smoothing"] = options.stream_smoothing
    if options.num_speculative_tokens is not None and mode == SPECULATIVE:
        body["num_speculative_tokens"] = options.num_speculative_tokens
    return body


def run_one(
    client: httpx.Client, url: str, prompt: Prompt, mode: str, options: RequestOptions, prompt_index: int = 0
) -> RequestResult:
    """Sends one streamed request; raises RuntimeError on an HTTP or in-stream error."""
    start = time.perf_counter()
    stamps: list[float] = []
    usage: dict = {}
    text: list[str] = []
    with client.stream("POST", f"{url}/v1/completions", json=request_body(prompt, mode, options)) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"].get("message")))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    stamps.append(time.perf_counter())
                    text.append(choice["text"])
    end = time.perf_counter()
    spec = usage.get("speculative_decoding") or {}
    return RequestResult(
        domain=prompt.domain,
        mode=mode,
        completion_tokens=int(usage.get("completion_tokens", 0)),
        ttft_s=(stamps[0] if stamps else end) - start,
        e2e_s=end - start,
        chunk_gaps_s=[b - a for a, b in pairwise(stamps)],
        rounds=int(spec.get("rounds", 0)),
        draft_tokens=int(spec.get("draft_tokens", 0)),
        accepted_tokens=int(spec.get("accepted_tokens", 0)),
        text="".join(text),
        prompt_index=prompt_index,
        started_at=start,
        extra={"fallbacks": spec.get("fallbacks"), "served_mode": spec.get("mode")} if spec else {},
    )


def served_model(client: httpx.Client, url: str) -> str:
    """The gateway's first model id (GET /v1/models)."""
    response = client.get(f"{url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]
