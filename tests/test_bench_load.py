"""tandem bench: which requests leave, in what order and when (closed and open loop), no network."""

from __future__ import annotations

import itertools
import statistics
import threading
import time

import pytest

from tandem.tools.bench.client import RequestResult
from tandem.tools.bench.load import Job, interleaved_jobs, mode_order, poisson_offsets, run_jobs
from tandem.tools.bench.prompts import Prompt, PromptFileError, load_prompts

PROMPTS = [Prompt("code", f"p{i}") for i in range(4)]


def test_modes_interleave_and_alternate() -> None:
    jobs = interleaved_jobs(PROMPTS)
    assert [(j.prompt_index, j.mode) for j in jobs] == [
        (0, "speculative"), (0, "autoregressive"), (1, "autoregressive"), (1, "speculative"),
        (2, "speculative"), (2, "autoregressive"), (3, "autoregressive"), (3, "speculative"),
    ]
    assert [j.index for j in jobs] == list(range(8))


def test_three_modes_and_peers_interleave_without_a_favourite() -> None:
    modes = ["speculative", "autoregressive", "auto"]
    jobs = interleaved_jobs([Prompt("code", f"p{i}") for i in range(6)], modes)
    orders = [[j.mode for j in jobs if j.prompt_index == i] for i in range(6)]
    assert orders[0] == modes and orders[1] == modes[::-1]
    assert len({tuple(o) for o in orders}) == 6  # every order of three modes once in six prompts
    assert [(j.index, j.prompt_index) for j in jobs] == [(i, i // 3) for i in range(18)]


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6])
def test_every_mode_runs_at_every_position_and_before_every_other_equally(count: int) -> None:
    modes = [f"m{i}" for i in range(count)] if count < 4 else ["speculative", "autoregressive", *(
        f"peer:127.0.0.1:{8080 + i}" for i in range(count - 2))]
    cycle = 2 * count if count % 2 else count
    orders = [mode_order(modes, k) for k in range(cycle)]
    assert all(sorted(o) == sorted(modes) for o in orders)
    for position in range(count):
        assert sorted(o[position] for o in orders) == sorted(modes * (cycle // count))
    for a, b in itertools.permutations(modes, 2):
        assert sum(o.index(a) < o.index(b) for o in orders) * 2 == cycle
    assert mode_order([], 3) == []


def test_overlapping_requests_run_each_mode_in_phases_of_its_own() -> None:
    """Where requests overlap, every mode (tandem's and each peer's) has phases of its own, in an
    order that turns with each pass over the prompt set; one request at a time, one phase."""
    from tandem.tools.bench.run import server_phases

    modes, peers = ["speculative", "autoregressive"], ["peer:h:1"]
    prompts = [Prompt("code", f"p{i}") for i in range(2)] * 3  # two prompts, --repeats 3
    assert server_phases(prompts, modes, peers, 3, concurrent=False) == [interleaved_jobs(prompts, [*modes, *peers])]
    phases = server_phases(prompts, modes, peers, 3, concurrent=True)
    groups = [sorted({job.mode for job in phase}) for phase in phases]
    assert groups == [["speculative"], ["autoregressive"], ["peer:h:1"],  # pass 0
                      ["autoregressive"], ["peer:h:1"], ["speculative"],  # pass 1 starts one further
                      ["peer:h:1"], ["speculative"], ["autoregressive"]]
    for number, phase in enumerate(phases):
        assert {job.prompt_index for job in phase} == {2 * (number // 3), 2 * (number // 3) + 1}
    assert [job.index for phase in phases for job in phase] == list(range(2 * 3 * 3))
    every = sorted((job.prompt_index, job.mode) for phase in phases for job in phase)
    assert every == sorted((job.prompt_index, job.mode) for job in interleaved_jobs(prompts, [*modes, *peers]))
    alone = server_phases(prompts, modes, [], 3, concurrent=True)  # no peer: tandem's modes apart too
    assert [sorted({job.mode for job in phase}) for phase in alone][:2] == [["speculative"], ["autoregressive"]]


def test_poisson_offsets_are_seeded_and_have_the_rate() -> None:
    a = poisson_offsets(2000, rate=10.0, seed=3)
    assert a == poisson_offsets(2000, rate=10.0, seed=3) and a != poisson_offsets(2000, rate=10.0, seed=4)
    assert a[0] == 0.0 and a == sorted(a)
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.1)
    with pytest.raises(ValueError, match="rate"):
        poisson_offsets(3, rate=0.0)


class Recorder:
    """A fake ``send``: sleeps, and records how many calls ran at once."""

    def __init__(self, delay: float, fail_on: int | None = None) -> None:
        self.delay = delay
        self.fail_on = fail_on
        self.in_flight = 0
        self.peak = 0
        self.starts: list[float] = []
        self.lock = threading.Lock()

    def __call__(self, job: Job) -> RequestResult:
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            self.starts.append(time.perf_counter())
        try:
            time.sleep(self.delay)
            if job.index == self.fail_on:
                raise RuntimeError("boom")
            return RequestResult(job.prompt.domain, job.mode, 3, 0.01, self.delay, [0.0], prompt_index=job.prompt_index)
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.mark.parametrize("concurrency", [1, 3])
def test_closed_loop_keeps_concurrency_in_flight(concurrency: int) -> None:
    send = Recorder(delay=0.05)
    done: list[RequestResult] = []
    results = run_jobs(interleaved_jobs(PROMPTS), send, concurrency=concurrency, on_done=done.append)
    assert send.peak == concurrency
    assert len(results) == len(done) == 8
    assert [(r.prompt_index, r.mode) for r in results] == [(j.prompt_index, j.mode) for j in interleaved_jobs(PROMPTS)]


def test_open_loop_does_not_wait_for_answers() -> None:
    # Arrivals at ~100/s and answers that take 0.2 s: an open loop has several in flight at once.
    send = Recorder(delay=0.2)
    results = run_jobs(interleaved_jobs(PROMPTS), send, request_rate=100.0, seed=1)
    assert send.peak > 1 and len(results) == 8
    assert all(r.queued_s >= 0.0 for r in results)


def test_open_loop_with_a_cap_queues_arrivals() -> None:
    send = Recorder(delay=0.05)
    results = run_jobs(interleaved_jobs(PROMPTS), send, concurrency=1, request_rate=1000.0)
    assert send.peak == 1
    assert max(r.queued_s for r in results) > 0.0  # later arrivals waited for the single slot


def test_a_failed_request_is_recorded_and_the_run_goes_on() -> None:
    results = run_jobs(interleaved_jobs(PROMPTS), Recorder(delay=0.0, fail_on=2), concurrency=2)
    assert len(results) == 8
    assert results[2].error == "RuntimeError: boom" and all(r.error is None for i, r in enumerate(results) if i != 2)


def test_bad_concurrency_is_refused() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        run_jobs([], Recorder(0.0), concurrency=0)


def test_prompt_sets(tmp_path) -> None:
    builtin = load_prompts()
    assert len(builtin) >= 20 and {"code", "json"} <= {p.domain for p in builtin}
    assert len(load_prompts(limit=3)) == 3
    path = tmp_path / "p.jsonl"
    path.write_text('{"domain": "a", "prompt": "x"}\n\n{"prompt": "y"}\n')
    assert load_prompts(str(path)) == [Prompt("a", "x"), Prompt("all", "y")]
    path.write_text('{"domain": "a"}\n')
    with pytest.raises(PromptFileError, match="line 1"):
        load_prompts(str(path))
    with pytest.raises(PromptFileError, match="cannot read"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_the_cli_parses_bench_and_calibrate_flags() -> None:
    from tandem import cli

    args = cli.build_parser().parse_args(
        ["bench", "--num-prompts", "2", "--concurrency", "4", "--request-rate", "2.5", "--plot", "b.png",
         "--json", "b.json", "--peer", "assisted", "--peer-assistant", "/d", "--no-progress", "--url", "http://h:1"])
    assert (args.limit, args.concurrency, args.request_rate, args.plot, args.json_path) == (2, 4, 2.5, "b.png", "b.json")
    assert (args.peer, args.peer_assistant, args.no_progress, args.url) == ("assisted", "/d", True, "http://h:1")
    args = cli.build_parser().parse_args(["bench", "--limit", "3"])
    assert (args.limit, args.url, args.peer, args.target_model, args.draft_model) == (
        3, None, "auto", "gemma-3-270m", "auto")
    args = cli.build_parser().parse_args(["calibrate", "--draft-model", "eagle", "--num-prompts", "4"])
    assert (args.draft_model, args.num_prompts, args.max_k, args.target_model) == ("eagle", 4, 8, "gemma-3-270m")
