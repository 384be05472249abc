"""One streamed completion against the gateway, timed chunk by chunk.

Speculation is chosen per request with the ``speculation`` extension field (``"on"``, ``"off"`` or
``"auto"``), so one gateway serves every mode of the same run; the final usage chunk carries the
speculative counters (rounds, drafted and accepted tokens, the mode that served, fallbacks) the
report turns into acceptance figures. ``stream_completion`` is the SSE reader shared with the
URL peers (``tandem.tools.bench.peers``).
"""

from __future__ import annotations

import contextlib
import json
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import httpx

from tandem.tools.bench.prompts import Prompt

SPECULATIVE = "speculative"
AUTOREGRESSIVE = "autoregressive"
AUTO = "auto"
PEER = "peer"  # the in-process transformers peer (tandem.tools.bench.peer)
MODES = (SPECULATIVE, AUTOREGRESSIVE)  # the default --modes on,off
TANDEM_MODES = (SPECULATIVE, AUTOREGRESSIVE, AUTO)  # every mode a tandem gateway serves, report order
_SPECULATION = {SPECULATIVE: "on", AUTOREGRESSIVE: "off", AUTO: "auto"}
# --modes values: the speculation field's own values, and the report's mode names.
_MODE_NAMES = {**{v: k for k, v in _SPECULATION.items()}, **{m: m for m in TANDEM_MODES}}


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
    """The request fields every mode shares (same prompts, same max tokens, same temperature)."""

    model: str
    max_tokens: int
    temperature: float | None = 0.0  # None: no temperature field, the server's default applies
    stream_smoothing: str | None = None  # None: the gateway's --stream-smoothing
    num_speculative_tokens: int | None = None  # None: the gateway's K
    # Truncation sent to every server, peers included (top_p, top_k, min_p: llama.cpp's and vLLM's
    # names too); empty: none sent, each server's default applies
    sampling: tuple[tuple[str, float], ...] = ()


@dataclass
class Streamed:
    """One SSE completion as it arrived: perf_counter times (s), text chunks, the usage object."""

    start: float
    end: float
    stamps: list[float]  # one per chunk that carried text
    texts: list[str]  # same length as stamps
    usage: dict

    def result(self, prompt: Prompt, mode: str, completion_tokens: int, prompt_index: int, **counters) -> RequestResult:
        return RequestResult(
            domain=prompt.domain,
            mode=mode,
            completion_tokens=completion_tokens,
            ttft_s=(self.stamps[0] if self.stamps else self.end) - self.start,
            e2e_s=self.end - self.start,
            chunk_gaps_s=[b - a for a, b in pairwise(self.stamps)],
            text="".join(self.texts),
            prompt_index=prompt_index,
            started_at=self.start,
            **counters,
        )


def parse_modes(text: str) -> tuple[str, ...]:
    """``--modes``: comma-separated ``on``/``off``/``auto`` (or the mode names) -> mode names, in order.

    Raises ValueError on an empty list, an unknown mode or a mode given twice.
    """
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError("--modes needs at least one of on, off, auto")
    unknown = [n for n in names if n not in _MODE_NAMES]
    if unknown:
        raise ValueError(f"--modes: unknown mode {unknown[0]!r} (choose from on, off, auto)")
    modes = [_MODE_NAMES[n] for n in names]
    if len(set(modes)) != len(modes):
        raise ValueError(f"--modes: a mode is given twice ({text!r})")
    return tuple(modes)


def parse_temperature(value: float | str | None) -> float | None:
    """``--temperature``: a float >= 0, or ``default``/``none`` -> None (no field sent)."""
    if value is None or isinstance(value, (int, float)):
        number = value
    elif value.strip().lower() in ("default", "none"):
        return None
    else:
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--temperature takes a number >= 0 or 'default' (got {value!r})") from None
    if number is not None and not number >= 0:
        raise ValueError(f"--temperature must be >= 0 (got {value!r})")
    return None if number is None else float(number)


def base_body(prompt: Prompt, options: RequestOptions) -> dict:
    """The fields every server gets: OpenAI's, and the truncation asked for (``--top-p``,
    ``--top-k``, ``--min-p``, which llama.cpp and vLLM read too); no tandem extension in here."""
    body = {
        "model": options.model,
        "prompt": prompt.prompt,
        "max_tokens": options.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.temperature is not None:
        body["temperature"] = options.temperature
    body.update(options.sampling)
    return body


def request_body(prompt: Prompt, mode: str, options: RequestOptions) -> dict:
    body = {**base_body(prompt, options), "speculation": _SPECULATION[mode]}
    if options.stream_smoothing is not None:
        body["stream_smoothing"] = options.stream_smoothing
    if options.num_speculative_tokens is not None and mode != AUTOREGRESSIVE:
        body["num_speculative_tokens"] = options.num_speculative_tokens
    return body


def key_hooks(url: str, api_key: str | None) -> dict[str, list]:
    """httpx event hooks that send ``api_key`` to the gateway at ``url`` and to no other server
    (the peers a run compares with get none)."""
    if not api_key:
        return {}
    origin = httpx.URL(url)

    def add_key(request: httpx.Request) -> None:
        if (request.url.scheme, request.url.host, request.url.port) == (origin.scheme, origin.host, origin.port):
            request.headers["Authorization"] = f"Bearer {api_key}"

    return {"request": [add_key]}


def trust(ca_file: str | None) -> ssl.SSLContext | bool:
    """What httpx verifies servers with: the system's CAs, plus ``ca_file``'s (an https:// gateway
    whose certificate a private CA signed); a missing file exits with its name."""
    if not ca_file:
        return True
    context = ssl.create_default_context()
    try:
        context.load_verify_locations(ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(f"tandem bench: --tls-ca: cannot load {ca_file}: {exc}") from None
    return context


def stream_completion(client: httpx.Client, url: str, body: dict) -> Streamed:
    """POSTs ``body`` to ``{url}/v1/completions`` and reads the SSE stream to its end.

    A request whose connection closed before any answer (a kept-alive connection the server had
    just dropped: llama-server closes idle ones) is sent once more on a fresh connection and timed
    from there; nothing was served the first time. Raises RuntimeError on an HTTP error status or
    an in-stream error object.
    """
    try:
        return _stream_once(client, url, body)
    except _Unanswered:
        return _stream_once(client, url, body, retry=False)


class _Unanswered(Exception):
    """The connection closed before the server sent a status line."""


def _stream_once(client: httpx.Client, url: str, body: dict, retry: bool = True) -> Streamed:
    start = time.perf_counter()
    stamps: list[float] = []
    texts: list[str] = []
    usage: dict = {}
    with contextlib.ExitStack() as stack:
        try:
            response = stack.enter_context(client.stream("POST", f"{url}/v1/completions", json=body))
        except httpx.RemoteProtocolError as exc:
            if retry:
                raise _Unanswered from exc
            raise
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                raise RuntimeError(str(error.get("message") if isinstance(error, dict) else error))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    stamps.append(time.perf_counter())
                    texts.append(choice["text"])
    return Streamed(start, time.perf_counter(), stamps, texts, usage)


def run_one(
    client: httpx.Client, url: str, prompt: Prompt, mode: str, options: RequestOptions, prompt_index: int = 0
) -> RequestResult:
    """Sends one streamed request to a tandem gateway; raises RuntimeError on an HTTP or in-stream error."""
    streamed = stream_completion(client, url, request_body(prompt, mode, options))
    spec = streamed.usage.get("speculative_decoding") or {}
    return streamed.result(
        prompt, mode, int(streamed.usage.get("completion_tokens", 0)), prompt_index,
        rounds=int(spec.get("rounds", 0)),
        draft_tokens=int(spec.get("draft_tokens", 0)),
        accepted_tokens=int(spec.get("accepted_tokens", 0)),
        extra={"fallbacks": spec.get("fallbacks"), "served_mode": spec.get("mode")} if spec else {},
    )


def served_model(client: httpx.Client, url: str) -> str:
    """The server's first model id (GET /v1/models)."""
    response = client.get(f"{url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def tandem_modes_of(results: Sequence[RequestResult]) -> list[str]:
    """The tandem modes present in ``results``, in report order."""
    present = {r.mode for r in results}
    return [m for m in TANDEM_MODES if m in present]
