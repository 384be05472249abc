"""URL peers (``--peer-url``): any OpenAI-compatible server measured with the same prompts.

llama.cpp's llama-server, vLLM, ollama or another tandem: each gets ``POST {url}/v1/completions``
with only standard OpenAI fields (model, prompt, max_tokens, temperature, stream,
``stream_options.include_usage``) and the truncation asked for (``--top-p``, ``--top-k``, ``--min-p``,
which llama.cpp and vLLM read too), never a tandem extension (speculation,
num_speculative_tokens, stream_smoothing): a peer is measured as it serves by default. Its
requests are interleaved with tandem's modes prompt by prompt (``load.interleaved_jobs``).

Rules:
- model: the peer's first id from ``GET {url}/v1/models``; a peer that answers no models list
  gets the tandem model id, and the report's config says so (``model_from``).
- completion tokens: from the usage chunk when the peer sends one, else the number of streamed
  chunks that carried text (``RequestResult.extra["tokens_from"]`` is ``"usage"`` or ``"chunks"``;
  a chunk may hold several tokens, so a count from chunks can be low).
- mode name: ``peer:<host>:<port>`` of the URL, with ``#2``, ``#3``, ... when URLs share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import httpx

from tandem.tools.bench.client import RequestOptions, RequestResult, base_body, served_model, stream_completion
from tandem.tools.bench.prompts import Prompt

PEER_PREFIX = "peer:"
MODELS_LIST = "GET /v1/models"


@dataclass(frozen=True)
class UrlPeer:
    """One ``--peer-url`` server, resolved before the run."""

    url: str  # base URL, no trailing slash nor /v1
    mode: str  # its mode name in the report, e.g. "peer:127.0.0.1:8080"
    model: str  # the model id sent in its requests
    model_from: str  # MODELS_LIST, or why the tandem model id is used

    def config(self) -> dict:
        return asdict(self)


def is_peer_mode(mode: str) -> bool:
    return mode.startswith(PEER_PREFIX)


def base_url(url: str) -> str:
    """``http://h:8080/``, ``http://h:8080/v1`` (an OpenAI SDK base_url) -> ``http://h:8080``."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def check_url(url: str) -> str | None:
    """What is wrong with a --peer-url value, or None."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"--peer-url takes an http(s) URL such as http://127.0.0.1:8080 (got {url!r})"
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        return f"--peer-url has a bad port (got {url!r})"
    return None


def peer_modes(urls: Sequence[str]) -> list[str]:
    """One distinct mode name per URL: ``peer:host:port``, then ``#2``, ``#3`` for repeats."""
    names: list[str] = []
    for url in urls:
        parts = urlsplit(url.strip())
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        name, n = f"{PEER_PREFIX}{host}:{port}", 2
        while name in names:
            name, n = f"{PEER_PREFIX}{host}:{port}#{n}", n + 1
        names.append(name)
    return names


def resolve_peers(client: httpx.Client, urls: Sequence[str], fallback_model: str) -> list[UrlPeer]:
    """Each URL with its mode name and model id (its first listed model, else ``fallback_model``)."""
    peers = []
    for url, mode in zip(urls, peer_modes(urls)):
        url = base_url(url)
        try:
            model, model_from = served_model(client, url), MODELS_LIST
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            model, model_from = fallback_model, f"the tandem model id ({MODELS_LIST} gave no model: {reason})"
        peers.append(UrlPeer(url, mode, model, model_from))
    return peers


def peer_body(prompt: Prompt, peer: UrlPeer, options: RequestOptions) -> dict:
    """Standard OpenAI fields only, with the peer's model id."""
    body = base_body(prompt, options)
    body["model"] = peer.model
    return body


def run_peer_one(
    client: httpx.Client, peer: UrlPeer, prompt: Prompt, options: RequestOptions, prompt_index: int = 0
) -> RequestResult:
    """One streamed request to a peer; raises RuntimeError on an HTTP or in-stream error."""
    streamed = stream_completion(client, peer.url, peer_body(prompt, peer, options))
    usage_tokens = streamed.usage.get("completion_tokens")
    if isinstance(usage_tokens, int) and not isinstance(usage_tokens, bool):
        tokens, source = usage_tokens, "usage"
    else:
        tokens, source = len(streamed.texts), "chunks"
    return streamed.result(prompt, peer.mode, tokens, prompt_index, extra={"tokens_from": source})


def tokens_from(results: Sequence[RequestResult]) -> str | None:
    """How a peer's completion tokens were counted: "usage", "chunks", "mixed", or None (no answer)."""
    sources = {r.extra.get("tokens_from") for r in results if not r.error}
    if not sources:
        return None
    return sources.pop() if len(sources) == 1 else "mixed"
