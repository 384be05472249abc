"""``tandem bench`` flags and the run: tandem's modes and the URL peers (interleaved), then the
in-process peer, then the report."""

from __future__ import annotations

import argparse
import os
import sys

import httpx

from tandem.tools.bench.client import (
    AUTOREGRESSIVE, SPECULATIVE, RequestOptions, key_hooks, parse_modes, parse_temperature, served_model, trust,
)
from tandem.tools.bench.peers import check_url, is_peer_mode, resolve_peers
from tandem.tools.bench.prompts import PromptFileError, load_prompts
from tandem.tools.bench.report import build_report, format_report, write_json
from tandem.tools.bench.run import peer_plan, run_http_phases, run_peer_phase
from tandem.config import DEFAULT_DRAFT

DEFAULT_URL = "http://127.0.0.1:8000"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.config import DEFAULT_K

    where = parser.add_argument_group("where (a running gateway, or a stack started for the run)")
    where.add_argument("--url", default=None,
                       help=f"gateway base URL; default: {DEFAULT_URL} if a gateway answers there, "
                            "else a stack started on free ports for the run")
    where.add_argument("--start-stack", action="store_true",
                       help="start a stack of its own even when a gateway answers on the default port")
    where.add_argument("--model", default=None, help="model id (default: the gateway's first model)")
    where.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"), metavar="KEY",
                       help="the gateway's API key, sent to the --url gateway only (default: env TANDEM_API_KEY)")
    where.add_argument("--tls-ca", default=os.environ.get("TANDEM_TLS_CA"), metavar="FILE",
                       help="a CA bundle to trust besides the system's, for an https:// gateway or peer "
                            "(default: env TANDEM_TLS_CA)")
    where.add_argument("--target-model", default="gemma-3-270m",
                       help="target SPEC of the started stack and of the peer (default gemma-3-270m)")
    where.add_argument(
        "--draft-model", default=DEFAULT_DRAFT,
        help=f"draft SPEC of the started stack (default {DEFAULT_DRAFT}: ngram+eagle where tandem ships an eagle head "
        "for the target, else ngram)"
    )
    where.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                       help="K: the started stack's default and the peer's; with --url also sent per request "
                            f"(default: the gateway's own; for a started stack tandem's default, {DEFAULT_K})")
    where.add_argument("--device", default="auto", help="device of the started stack and of the peer")
    where.add_argument("--dtype", default="auto", help="dtype of the started stack and of the peer")
    load = parser.add_argument_group("load")
    load.add_argument("--prompts", default=None,
                      help="JSONL with {domain, prompt} rows (default: the built-in set, bench/prompts.jsonl)")
    load.add_argument("--limit", "--num-prompts", dest="limit", type=int, default=0,
                      help="use only the first N prompts (0 = all)")
    load.add_argument("--repeats", type=int, default=1, metavar="N",
                      help="send the prompt set N times in each mode (and to the peer): steadier figures on a "
                           "noisy machine (default 1)")
    load.add_argument("--max-tokens", type=int, default=64, help="tokens per request, same in every mode")
    load.add_argument("--modes", default="on,off", metavar="LIST",
                      help="tandem modes to run, comma-separated: on (speculative), off (autoregressive), auto "
                           "(the gateway's default speculation: auto) (default on,off)")
    load.add_argument("--temperature", default=0.0, metavar="T",
                      help="sampling temperature (default 0: greedy); 'default' (or 'none'): send no temperature, "
                           "the server's default applies")
    load.add_argument("--top-p", type=float, default=None, metavar="P",
                      help="top_p of every request, peers' too (default: none sent)")
    load.add_argument("--top-k", type=int, default=None, metavar="K",
                      help="top_k of every request, peers' too (llama.cpp's and vLLM's field; default: none sent)")
    load.add_argument("--min-p", type=float, default=None, metavar="P",
                      help="min_p of every request, peers' too (llama.cpp's and vLLM's field; default: none sent)")
    load.add_argument("--concurrency", type=int, default=None,
                      help="requests in flight at once (default 1; with --request-rate: no cap)")
    load.add_argument("--request-rate", type=float, default=0.0,
                      help="open loop: Poisson arrivals at R requests/s (default 0: closed loop)")
    load.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    load.add_argument("--warmup", type=int, default=1, help="requests per mode (peers included) before measuring")
    load.add_argument("--stream-smoothing", choices=("off", "auto"), default=None,
                      help="the stream_smoothing field of each request (default: the gateway's setting)")
    peers = parser.add_argument_group(
        "peers", "other OpenAI-compatible servers (--peer-url), interleaved with tandem's modes (where requests "
        "overlap, each server in phases of its own); then transformers' "
        "assisted generation (--peer), in-process, alone on the machine")
    peers.add_argument("--peer-url", action="append", default=None, metavar="URL",
                       help="an OpenAI-compatible server (llama-server, vLLM, ollama, another tandem) sent the same "
                            "prompts with standard fields only, reported as mode peer:HOST:PORT; repeatable")
    peers.add_argument("--peer", choices=("auto", "assisted", "none"), default="auto",
                       help="transformers' assisted generation; auto (default): run it when --target-model is the "
                            "served model and loads locally")
    peers.add_argument("--peer-assistant", default=None, metavar="SPEC",
                       help="HF draft with the target's tokenizer for generate(assistant_model=...); "
                            "default: prompt lookup (prompt_lookup_num_tokens=K)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", dest="json_path", default=None, help="write the report as JSON here")
    out.add_argument("--plot", default=None, metavar="FILE.png", help="draw tokens/s by domain and the ITL CDF")
    out.add_argument("--no-progress", action="store_true", help="no progress bar (also off when stderr is no TTY)")


def sampling_fields(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """The truncation ``--top-p``, ``--top-k`` and ``--min-p`` ask every request for."""
    given = (("top_p", getattr(args, "top_p", None)), ("top_k", getattr(args, "top_k", None)),
             ("min_p", getattr(args, "min_p", None)))
    return tuple((name, value) for name, value in given if value is not None)


def _check(args: argparse.Namespace) -> None:
    """Refuses bad flags with one ``tandem bench: ...`` message; parses --modes and --temperature in place."""
    problems = []
    try:
        args.modes = parse_modes(args.modes) if isinstance(args.modes, str) else tuple(args.modes)
    except ValueError as exc:
        problems.append(str(exc))
    try:
        args.temperature = parse_temperature(args.temperature)
    except ValueError as exc:
        problems.append(str(exc))
    for flag, value, ok in (("--top-p", args.top_p, lambda v: 0 < v <= 1), ("--top-k", args.top_k, lambda v: v >= 0),
                            ("--min-p", args.min_p, lambda v: 0 <= v <= 1)):
        if value is not None and not ok(value):
            problems.append(f"{flag} is out of range (got {value})")
    args.peer_url = list(args.peer_url or [])
    problems += [p for p in map(check_url, args.peer_url) if p]
    if args.max_tokens < 1:
        problems.append(f"--max-tokens must be >= 1 (got {args.max_tokens})")
    if args.repeats < 1:
        problems.append(f"--repeats must be >= 1 (got {args.repeats})")
    if args.concurrency is not None and args.concurrency < 1:
        problems.append(f"--concurrency must be >= 1 (got {args.concurrency})")
    if args.request_rate < 0:
        problems.append(f"--request-rate must be >= 0 (got {args.request_rate})")
    if args.limit < 0:
        problems.append(f"--num-prompts/--limit must be >= 0 (got {args.limit})")
    if args.warmup < 0:
        problems.append(f"--warmup must be >= 0 (got {args.warmup})")
    if args.num_speculative_tokens is not None and not 1 <= args.num_speculative_tokens <= 64:
        problems.append(f"--num-speculative-tokens must be in 1..64 (got {args.num_speculative_tokens})")
    if args.plot and not args.plot.lower().endswith(".png"):
        problems.append(f"--plot writes a PNG: give a .png path (got {args.plot})")
    if problems:
        raise SystemExit("tandem bench: " + "; ".join(problems))


def _gateway_answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=1.0).status_code in (200, 401)  # 401: it wants a key
    except httpx.HTTPError:
        return False


def _start_stack(args: argparse.Namespace, k: int):
    from tandem.tools.bench.stack import OwnStack, StackError
    from tandem.models import resolve_draft_spec

    args.draft_model = resolve_draft_spec(args.draft_model, args.target_model)
    own = OwnStack(args.target_model, args.draft_model, k, args.device, args.dtype)
    print(f"tandem bench: starting tandem serve ({args.target_model} + {args.draft_model}, K={k}) "
          "on free ports ...", file=sys.stderr)
    try:
        own.start()
    except StackError as exc:
        raise SystemExit(f"tandem bench: {exc}") from exc
    return own


def _config(args: argparse.Namespace, num_prompts: int, k: int, own_stack: bool, skip: str | None, peers) -> dict:
    return {
        "prompts": args.prompts or "built-in (bench/prompts.jsonl)",
        "num_prompts": num_prompts,
        "repeats": args.repeats,
        "concurrency": args.concurrency or (None if args.request_rate > 0 else 1),
        "request_rate": args.request_rate,
        "seed": args.seed,
        "warmup": args.warmup,
        "temperature": "default" if args.temperature is None else args.temperature,
        "sampling": dict(sampling_fields(args)),
        "stream_smoothing": args.stream_smoothing,
        "num_speculative_tokens": k if own_stack else args.num_speculative_tokens,
        "stack": "started" if own_stack else "external",
        "target_model": args.target_model,
        "draft_model": args.draft_model if own_stack else None,
        "peer_skipped": skip,
        "modes": list(args.modes),
        "peers": [peer.config() for peer in peers],
    }


def main(args: argparse.Namespace) -> int:
    _check(args)
    try:
        distinct = load_prompts(args.prompts, args.limit)
    except PromptFileError as exc:
        raise SystemExit(f"tandem bench: {exc}") from exc
    prompts = list(distinct) * args.repeats  # each pass over the set in turn, every mode interleaved
    progress = not args.no_progress and sys.stderr.isatty()
    from tandem.config import DEFAULT_K

    k = args.num_speculative_tokens or DEFAULT_K
    own = None
    url = args.url
    if url is None and not args.start_stack and _gateway_answers(DEFAULT_URL):
        url = DEFAULT_URL
        print(f"tandem bench: using the gateway at {url} (pass --start-stack for a stack of its own)", file=sys.stderr)
    if url is None:
        own = _start_stack(args, k)
        url = own.url
    try:
        with httpx.Client(timeout=10.0, event_hooks=key_hooks(url, args.api_key), verify=trust(args.tls_ca)) as client:
            model_id = args.model or served_model(client, url)
            peers = resolve_peers(client, args.peer_url, model_id)
        options = RequestOptions(model_id, args.max_tokens, args.temperature, args.stream_smoothing,
                                 args.num_speculative_tokens if own is None else None, sampling_fields(args))
        results, duration = run_http_phases(url, peers, prompts, options, args.modes, args, progress)
    except (httpx.HTTPError, RuntimeError) as exc:
        raise SystemExit(f"tandem bench: the gateway at {url} failed: {exc}") from exc
    finally:
        if own is not None:
            own.stop()
    peer_report, peer_results, status = None, [], 0
    skip = peer_plan(args, model_id, own is not None)
    if skip is None:
        from tandem.tools.bench.peer import PeerError

        try:
            peer_report, peer_results = run_peer_phase(args, prompts, k, results, progress)
        except PeerError as exc:
            print(f"tandem bench: {exc}", file=sys.stderr)
            status = 1 if args.peer == "assisted" else 0
    elif args.peer != "none":
        print(f"tandem bench: peer skipped: {skip}", file=sys.stderr)
    report = build_report(url, model_id, args.max_tokens, results, peer_report, duration,
                          _config(args, len(distinct), k, own is not None, skip, peers),
                          modes=args.modes, url_peers=peers, greedy=args.temperature == 0)
    print(format_report(report))
    if args.json_path:
        write_json(report, args.json_path)
    if args.plot:
        from tandem.tools.bench.plot import write_plot

        write_plot(report, [*results, *peer_results], args.plot)
    for peer in report.peers:
        if peer.failed and peer.failed == len(prompts):
            print(f"tandem bench: every request to {peer.mode} ({peer.url}) failed", file=sys.stderr)
    tandem = [r for r in results if not is_peer_mode(r.mode)]
    if all(r.error for r in tandem):
        print("tandem bench: every request failed", file=sys.stderr)
        return 1
    return status


__all__ = ["AUTOREGRESSIVE", "SPECULATIVE", "add_arguments", "main"]
