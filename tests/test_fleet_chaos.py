"""Chaos on a local fleet (issue 26 §5): ``tandem serve --targets 3 --drafts 2`` on the tiny model,
12 concurrent greedy streams; mid-stream one target and one draft are SIGKILLed and another target
is SIGSTOPped for longer than the gateway's target deadline. Every stream must end with exactly the
tokens of a run without faults, the killed children come back and take new sessions, and nothing
leaks: every target and draft ends with no session and its whole KV budget free."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import httpx
import pytest

from stack import Fleet, metric_value, running_fleet
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc

STREAMS = 12
MAX_TOKENS = 64  # long enough that every stream is under way through the faults (~13 s each here)
TARGET_TIMEOUT_S = 1.5
PROMPTS = [f"Story {i}: once upon a time, in a land of {w}," for i, w in
           enumerate(["rivers", "stone", "glass", "wind", "salt", "moss", "iron", "snow", "reeds", "dust", "fire", "rain"])]


def stream(fleet: Fleet, prompt: str, arrivals: list[float] | None = None, **fields) -> list[int]:
    """One greedy gRPC stream; ``arrivals`` gets the time of each chunk."""
    with grpc.insecure_channel(fleet.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GatewayServiceGenerateRequest(
            prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
            speculation=common_pb2.SPECULATION_MODE_ON, **fields)
        ids: list[int] = []
        for chunk in stub.Generate(request, timeout=240):
            ids.extend(chunk.token_ids)
            if arrivals is not None and chunk.token_ids:
                arrivals.append(time.monotonic())
    return ids


def concurrently(work, n: int) -> list:
    """``work(i)`` for i in range(n) on threads; the results in order (an exception re-raised)."""
    results: list = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def target_load(address: str) -> target_pb2.TargetServiceInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.TargetServiceInfoRequest(), timeout=5)


def draft_load(address: str) -> draft_pb2.DraftServiceInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return draft_pb2_grpc.DraftServiceStub(channel).Info(draft_pb2.DraftServiceInfoRequest(), timeout=5)


def wait_for(condition, timeout_s: float, what: str, fleet: Fleet):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = condition()
        except grpc.RpcError:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout_s}s:\n{fleet.log()}")


@pytest.mark.timeout(900)
def test_streams_survive_killed_and_hung_children_with_the_same_tokens(tiny_dir, tiny_draft_dir) -> None:
    env = {"TANDEM_TARGET_TIMEOUT_S": str(TARGET_TIMEOUT_S), "TANDEM_FAILOVER_WAIT_S": "120",
           "TANDEM_DRAFT_STALL_TIMEOUT_S": "3"}
    with running_fleet(str(tiny_dir), str(tiny_draft_dir), targets=3, drafts=2, env=env) as fleet:
        targets, drafts = fleet.names("target"), fleet.names("draft")
        assert len(targets) == 3 and len(drafts) == 2
        # The reference: each prompt once, with nothing failing.
        expected = concurrently(lambda i: stream(fleet, PROMPTS[i]), STREAMS)
        assert all(len(ids) == MAX_TOKENS for ids in expected)

        results: list[list[int] | BaseException | None] = [None] * STREAMS
        arrivals: list[list[float]] = [[] for _ in range(STREAMS)]

        def run(i: int) -> None:
            try:
                results[i] = stream(fleet, PROMPTS[i], arrivals[i])
            except BaseException as exc:  # reported below, with the fleet's log
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
        for thread in threads:
            thread.start()
        wait_for(lambda: all(len(a) >= 3 for a in arrivals), 120, "every stream under way", fleet)
        killed_target, hung_target, killed_draft = targets[0], targets[1], drafts[0]
        # Placement spread the streams: the targets about to fail hold some of them.
        assert all(target_load(fleet.addresses[name]).active_sessions > 0 for name in targets), fleet.log()
        pids = {name: fleet.pid(name) for name in (killed_target, hung_target, killed_draft)}
        os.kill(pids[killed_target], signal.SIGKILL)
        os.kill(pids[killed_draft], signal.SIGKILL)
        os.kill(pids[hung_target], signal.SIGSTOP)
        try:
            time.sleep(3 * TARGET_TIMEOUT_S)
        finally:
            os.kill(pids[hung_target], signal.SIGCONT)
        for thread in threads:
            thread.join(timeout=300)
        failures = [r for r in results if not isinstance(r, list)]
        assert not failures, f"{failures}\n{fleet.log()}"
        for i in range(STREAMS):
            assert results[i] == expected[i], f"stream {i} differs\n{fleet.log()}"

        # The killed children are restarted on their ports and take new sessions.
        for name in (killed_target, killed_draft):
            wait_for(lambda name=name: fleet.pid(name) not in (None, pids[name]), 120, f"{name} restarted", fleet)
        wait_for(lambda: target_load(fleet.addresses[killed_target]).model_name, 120,
                 f"{killed_target} serving again", fleet)
        time.sleep(3)  # the gateway's health check takes it back
        busy = {}
        threads = [threading.Thread(target=stream, args=(fleet, PROMPTS[i])) for i in range(6)]
        for thread in threads:
            thread.start()

        def placed_on_restarted() -> bool:
            busy[killed_target] = max(busy.get(killed_target, 0),
                                      target_load(fleet.addresses[killed_target]).active_sessions)
            return busy[killed_target] > 0

        wait_for(placed_on_restarted, 60, f"a new session on the restarted {killed_target}", fleet)
        for thread in threads:
            thread.join(timeout=300)

        # Nothing leaks: every session released, every KV budget whole again, in every child.
        def idle() -> bool:
            loads = [target_load(fleet.addresses[name]) for name in targets]
            return (all(load.active_sessions == 0 and load.kv_free_tokens == load.kv_capacity_tokens for load in loads)
                    and all(draft_load(fleet.addresses[name]).active_sessions == 0 for name in drafts))

        wait_for(idle, 30, "every target and draft idle", fleet)
        metrics = httpx.get(f"{fleet.base_url}/metrics", timeout=10).text
        moves = "\n".join(line for line in metrics.splitlines() if "failovers" in line or "fallbacks" in line)
        story = "\n".join(line for line in fleet.output if "continuing" in line or "out of the pool" in line)
        assert metric_value(metrics, "tandem_session_failovers_total", reason="unavailable") >= 1, f"{moves}\n{story}"
        assert metric_value(metrics, "tandem_session_failovers_total", reason="timeout") >= 1, f"{moves}\n{story}"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_on_gemma_a_stream_outlives_the_target_it_started_on() -> None:
    """The default model, two targets and one draft: the target holding the only stream is
    SIGKILLed mid-stream; the stream ends with the tokens of a run without the kill."""
    env = {"TANDEM_TARGET_TIMEOUT_S": "10", "TANDEM_FAILOVER_WAIT_S": "120"}
    with running_fleet("gemma-3-270m", "ngram", targets=2, drafts=1, k=5, env=env, ready_timeout_s=900) as fleet:
        prompt = "Write a short story about a lighthouse keeper who"
        expected = stream(fleet, prompt)
        arrivals: list[float] = []
        result: list = []
        thread = threading.Thread(target=lambda: result.append(stream(fleet, prompt, arrivals)))
        thread.start()
        wait_for(lambda: len(arrivals) >= 4, 120, "the stream under way", fleet)
        members = httpx.get(f"{fleet.base_url}/health", timeout=10).json()["target"]["members"]
        (holder,) = [m["address"] for m in members if m["sessions"] == 1]
        name = next(n for n, a in fleet.addresses.items() if a.rsplit(":", 1)[1] == holder.rsplit(":", 1)[1])
        os.kill(fleet.pid(name), signal.SIGKILL)
        thread.join(timeout=600)
        assert result == [expected], fleet.log()
        metrics = httpx.get(f"{fleet.base_url}/metrics", timeout=10).text
        assert metric_value(metrics, "tandem_session_failovers_total", reason="unavailable") == 1
