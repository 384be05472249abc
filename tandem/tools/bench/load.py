"""Load generation: which requests go out, in what order, and when.

Every mode of a prompt (tandem's, and each URL peer's) is queued next to the others, and their
order changes from prompt to prompt (see ``interleaved_jobs``), so no mode systematically runs first
on a warm cache or on a quieter machine. Two ways to pace them:

- closed loop (default): ``concurrency`` requests in flight; the next one leaves when one finishes.
- open loop (``request_rate`` > 0): arrivals form a Poisson process of that rate (exponential gaps,
  seeded) whatever the server's speed; an arrival that finds ``concurrency`` requests in flight
  waits for a slot, and that wait is recorded (``queued_s``) but not counted in TTFT.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from tandem.tools.bench.client import MODES, RequestResult
from tandem.tools.bench.prompts import Prompt

# Open loop with no --concurrency: in-flight requests are capped only by this many threads.
OPEN_LOOP_MAX_IN_FLIGHT = 256


@dataclass(frozen=True)
class Job:
    index: int  # position in the schedule
    prompt_index: int
    prompt: Prompt
    mode: str


def mode_order(modes: Sequence[str], prompt_index: int) -> list[str]:
    """The order of the modes for one prompt: prompt 2j gets them rotated left by 2j, prompt 2j+1
    the reverse of that.

    So every pair of modes runs in each order equally often (each pair of prompts), and every mode
    runs at every position equally often: over N prompts for N modes when N is even, 2N when odd.
    With two modes this is plain alternation (A B, B A, A B, ...).
    """
    if not modes:
        return []
    shift = (prompt_index - prompt_index % 2) % len(modes)
    order = [*modes[shift:], *modes[:shift]]
    return order[::-1] if prompt_index % 2 else order


def interleaved_jobs(prompts: Sequence[Prompt], modes: Sequence[str] = MODES, first_index: int = 0) -> list[Job]:
    """Every prompt once per mode, the modes of a prompt next to each other in ``mode_order``;
    prompts are numbered from ``first_index`` (a slice of a longer schedule keeps its numbers)."""
    modes = list(modes)
    jobs: list[Job] = []
    for prompt_index, prompt in enumerate(prompts, start=first_index):
        for mode in mode_order(modes, prompt_index):
            jobs.append(Job(len(jobs), prompt_index, prompt, mode))
    return jobs


def poisson_offsets(count: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process of ``rate`` per second; the
    first request leaves at 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for i in range(count):
        if i:
            now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def run_jobs(
    jobs: Sequence[Job],
    send: Callable[[Job], RequestResult],
    concurrency: int | None = None,
    request_rate: float = 0.0,
    seed: int = 0,
    on_done: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Runs ``send`` for every job under the chosen pacing; results come back in schedule order.

    A job whose ``send`` raises gives a result with ``error`` set (the run goes on).
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    open_loop = request_rate > 0
    workers = concurrency or (OPEN_LOOP_MAX_IN_FLIGHT if open_loop else 1)
    results: list[RequestResult | None] = [None] * len(jobs)
    lock = threading.Lock()

    def task(position: int, job: Job, arrival: float) -> None:
        queued = time.perf_counter() - arrival
        try:
            result = send(job)
        except Exception as exc:  # noqa: BLE001 (one failed request must not end the run)
            result = RequestResult(job.prompt.domain, job.mode, 0, 0.0, 0.0, [], prompt_index=job.prompt_index,
                                   started_at=time.perf_counter(), error=f"{type(exc).__name__}: {exc}")
        result.queued_s = max(0.0, queued) if open_loop else 0.0
        with lock:
            results[position] = result
            if on_done is not None:
                on_done(result)

    start = time.perf_counter()
    offsets = poisson_offsets(len(jobs), request_rate, seed) if open_loop else [0.0] * len(jobs)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench") as pool:
        futures: list[Future] = []
        for position, (job, offset) in enumerate(zip(jobs, offsets)):
            if open_loop:
                time.sleep(max(0.0, start + offset - time.perf_counter()))
            futures.append(pool.submit(task, position, job, time.perf_counter()))
        for future in futures:
            future.result()
    return [r for r in results if r is not None]
