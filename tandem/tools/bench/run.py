"""The measured phases of ``tandem bench``: tandem's modes and the URL peers over HTTP (interleaved,
under the chosen load), then the in-process transformers peer alone on the machine."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from collections.abc import Sequence

import httpx

from tandem.tools.bench.client import RequestOptions, RequestResult, key_hooks, run_one, trust
from tandem.tools.bench.load import Job, interleaved_jobs, run_jobs
from tandem.tools.bench.peers import UrlPeer, run_peer_one
from tandem.tools.bench.prompts import Prompt
from tandem.tools.bench.report import PeerReport, summarize_peer

# Read timeout of one streamed request (s): a slow CPU peer may take minutes for a long answer.
REQUEST_TIMEOUT_S = 600.0


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=not enabled, dynamic_ncols=True)


def _warm_up(client: httpx.Client, url: str, prompts: Sequence[Prompt], modes: Sequence[str],
             peers: Sequence[UrlPeer], options: RequestOptions) -> None:
    """Every mode, peers included, answers the first prompts once (shorter) before the clock starts.

    A tandem mode that fails here ends the run (the gateway is broken); a peer that fails is only
    reported on stderr: its measured requests will fail and be counted too.
    """
    for mode in modes:
        for prompt in prompts:
            run_one(client, url, prompt, mode, options)
    for peer in peers:
        for prompt in prompts:
            try:
                run_peer_one(client, peer, prompt, options)
            except Exception as exc:  # noqa: BLE001 (a broken peer must not end the run)
                print(f"tandem bench: warm-up of {peer.mode} ({peer.url}) failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
                break


def run_http_phases(
    url: str, peers: Sequence[UrlPeer], prompts: Sequence[Prompt], options: RequestOptions, modes: Sequence[str],
    args: argparse.Namespace, progress: bool,
) -> tuple[list[RequestResult], float]:
    """Warm-up, then every prompt in every tandem mode and to every peer (interleaved per prompt);
    returns the results (schedule order) and the measured wall time (s)."""
    by_mode = {peer.mode: peer for peer in peers}
    hooks = key_hooks(url, getattr(args, "api_key", None))
    verify = trust(getattr(args, "tls_ca", None))
    with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0), event_hooks=hooks, verify=verify) as client:
        warm = dataclasses.replace(options, max_tokens=min(8, options.max_tokens))
        _warm_up(client, url, prompts[: args.warmup], modes, peers, warm)

        def send(job: Job) -> RequestResult:
            peer = by_mode.get(job.mode)
            if peer is not None:
                return run_peer_one(client, peer, job.prompt, options, job.prompt_index)
            return run_one(client, url, job.prompt, job.mode, options, job.prompt_index)

        phases = server_phases(prompts, modes, list(by_mode), args.repeats, concurrent=load_overlaps(args))
        bar = progress_bar(sum(len(jobs) for jobs in phases), "bench " + "/".join([*modes, *by_mode]), progress)
        started = time.perf_counter()
        results: list[RequestResult] = []
        try:
            for jobs in phases:
                results += run_jobs(jobs, send, concurrency=args.concurrency, request_rate=args.request_rate,
                                    seed=args.seed, on_done=lambda _result: bar.update(1))
        finally:
            bar.close()
        return results, time.perf_counter() - started


def load_overlaps(args: argparse.Namespace) -> bool:
    """Whether more than one request is in flight at a time (closed loop above 1, or open loop)."""
    return (args.concurrency or 1) > 1 or args.request_rate > 0


def server_phases(prompts: Sequence[Prompt], modes: Sequence[str], peer_modes: Sequence[str], repeats: int,
                  concurrent: bool) -> list[list[Job]]:
    """The schedule as phases run one after another, each a list of jobs run under the load.

    One request at a time, every mode of a prompt, tandem's and each peer's, runs next to the
    others (one phase). Where requests overlap, each mode runs in a phase of its own: a mode's figure
    is then what a server carrying only that mode's traffic gives. Sharing the load would measure
    the mix instead (on one server, speculative sessions' rows slow the autoregressive sessions
    beside them in every shared pass; two servers on one machine each take the other's cores).
    The order turns by one for each pass over the prompt set (``repeats``), so none always goes
    first (the first phase after a start also warms the server)."""
    if not concurrent:
        return [interleaved_jobs(prompts, [*modes, *peer_modes])]
    groups = [[mode] for mode in [*modes, *peer_modes]]
    per_pass = len(prompts) // repeats if repeats > 0 and len(prompts) % repeats == 0 else len(prompts)
    phases = []
    for start in range(0, len(prompts), per_pass):
        turn = start // per_pass
        for group in groups[turn % len(groups):] + groups[: turn % len(groups)]:
            phases.append(interleaved_jobs(prompts[start : start + per_pass], group, first_index=start))
    positions = itertools.count()  # a job's index is its place in the whole schedule
    return [[dataclasses.replace(job, index=next(positions)) for job in phase] for phase in phases]


def peer_plan(args: argparse.Namespace, model_id: str, own_stack: bool) -> str | None:
    """Why the in-process transformers peer is skipped, or None to run it."""
    from tandem import models

    if args.peer == "none":
        return "--peer none"
    if args.temperature is None:
        return "the peer is greedy only (--temperature default: the server's default applies)"
    if args.temperature > 0:
        return "the peer is greedy only (--temperature > 0)"
    if args.peer == "auto":
        if not own_stack and model_id != models.default_served_name(args.target_model):
            return (f"the gateway serves {model_id!r}, not --target-model {args.target_model!r} "
                    "(pass --target-model, or --peer assisted to force it)")
        try:
            models.resolve(args.target_model)
        except (models.ModelSpecError, OSError, ImportError) as exc:
            return f"the target is not available locally ({exc})"
    return None


def run_peer_phase(
    args: argparse.Namespace, prompts: Sequence[Prompt], k: int, stack_results: Sequence[RequestResult], progress: bool
) -> tuple[PeerReport, list[RequestResult]]:
    from tandem.tools.bench.peer import run_peer

    bar = progress_bar(len(prompts), "bench peer", progress)
    try:
        run = run_peer(args.target_model, args.peer_assistant, prompts, args.max_tokens, k, args.device, args.dtype,
                       warmup=args.warmup, on_done=lambda _result: bar.update(1))
    finally:
        bar.close()
    report = summarize_peer(run.results, stack_results, run.assistant, args.target_model, k, run.device, run.dtype)
    return report, run.results
