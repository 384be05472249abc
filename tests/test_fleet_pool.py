"""Pool membership, DNS re-resolution and placement (gateway.pool, tandem.rpc.addresses), and the
monitor's work on pools: all with fakes, no sockets."""

from __future__ import annotations

import asyncio

import pytest

from gateway.breaker import BreakerConfig, DraftBreaker, DraftFailure
from gateway.monitor import UpstreamMonitor
from gateway.pool import Pool
from gateway.served_model import ServedModel
from tandem.rpc import addresses
from tandem.v1 import draft_pb2, target_pb2


class FakeDns:
    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = records
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if host not in self.records:
            raise OSError(f"unknown host {host}")
        return list(self.records[host])


class Client:
    def __init__(self, address: str, server_name: str = "") -> None:
        self.address = address
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def test_address_lists_parse_and_refuse_what_is_not_host_port():
    entries = addresses.parse(" 10.0.0.1:50053, target:50053,[::1]:7 ,localhost:9")
    assert [(e.host, e.port, e.literal) for e in entries] == [
        ("10.0.0.1", 50053, True), ("target", 50053, False), ("::1", 7, True), ("localhost", 9, True)]
    assert entries[2].member() == "[::1]:7"
    for bad in ("", "target", "target:http", "a:1,:2", "a:0", "a:70000"):
        with pytest.raises(ValueError):
            addresses.parse(bad, "target address")


async def test_a_dns_name_stands_for_every_address_and_the_pool_follows_it():
    dns = FakeDns({"target": ["10.0.0.1", "10.0.0.2", "10.0.0.1"]})
    pool = Pool("target", "target:50053,10.0.0.9:50053", Client, lookup=dns, close=Client.close)
    removed: list[str] = []
    pool.on_removed = removed.append
    assert pool.members == {}  # a name is not known before it resolves
    await pool.resolve()
    assert list(pool.members) == ["10.0.0.1:50053", "10.0.0.2:50053", "10.0.0.9:50053"]
    for member in pool.members.values():
        member.serving = True
    held = pool.place()
    assert held is not None
    # The pool shrinks: the member with a session stays until it ends, taking no new sessions.
    dns.records["target"] = ["10.0.0.3"] if held.address != "10.0.0.1:50053" else ["10.0.0.2"]
    gone_busy = held.address
    await pool.resolve()
    assert pool.members[gone_busy].leaving and not pool.members[gone_busy].usable
    assert all(pool.place().address != gone_busy for _ in range(6))
    held.close()
    client = pool.members[gone_busy].client
    await pool.resolve()
    assert gone_busy not in pool.members and client.closed
    assert gone_busy in removed and not set(removed) & set(pool.members) and len(set(removed)) == len(removed)
    # A failed lookup is not an empty pool: nobody leaves.
    before = set(pool.members)
    del dns.records["target"]
    await pool.resolve()
    assert set(pool.members) == before


def test_placement_prefers_the_least_loaded_usable_member_and_spreads_ties():
    pool = Pool.of("target", {"a:1": Client("a"), "b:1": Client("b"), "c:1": Client("c")})
    first = [pool.place() for _ in range(3)]
    assert sorted(p.address for p in first) == ["a:1", "b:1", "c:1"]  # one each
    pool.members["a:1"].report(6)  # another gateway's sessions count too (5 beyond this one's)
    assert {pool.place().address for _ in range(2)} == {"b:1", "c:1"}
    pool.take_out(pool.members["b:1"], "connection refused")
    assert pool.place().address == "c:1"
    assert pool.place(avoid=frozenset({"c:1"})).address == "a:1"
    # With every other member out, an avoided member is still better than none.
    pool.take_out(pool.members["a:1"], "hung")
    assert pool.place(avoid=frozenset({"c:1"})).address == "c:1"
    pool.take_out(pool.members["c:1"], "gone")
    assert pool.place() is None and not pool.can_place()
    assert "the target service at a:1 is unavailable (hung)" in pool.unavailable()


def test_placements_count_sessions_once_and_feed_the_gauge():
    seen: list[tuple[str, int]] = []
    pool = Pool.of("target", {"a:1": Client("a")})
    pool.on_sessions = lambda member: seen.append((member.address, member.sessions))
    placement = pool.place()
    placement.close()
    placement.close()
    assert seen == [("a:1", 1), ("a:1", 0)] and pool.members["a:1"].sessions == 0


def test_a_draft_whose_breaker_is_open_takes_no_legs():
    pool = Pool.of("draft", {"d0:1": Client("d0"), "d1:1": Client("d1")},
                   breaker=lambda: DraftBreaker(BreakerConfig(cooldown_s=0.0)))
    pool.members["d0:1"].breaker.record_failure(DraftFailure.UNREACHABLE)
    assert {pool.place().address for _ in range(4)} == {"d1:1"}
    assert pool.can_place() and not pool.can_place(frozenset({"d1:1"}))
    assert pool.to_json()["members"][0]["breaker"] == "open"
    pool.members["d1:1"].breaker.record_failure(DraftFailure.UNREACHABLE)
    assert pool.place() is None  # no draft is known to serve ...
    assert pool.place(anyhow=True) is not None  # ... but a session that insists on speculation tries one


class FakeTarget(Client):
    def __init__(self, address: str, fingerprint: str) -> None:
        super().__init__(address)
        self.up = True
        self.fingerprint = fingerprint
        self.released: list[str] = []

    async def is_serving(self, timeout: float) -> bool:
        return self.up

    async def info(self, timeout: float) -> target_pb2.TargetServiceInfoResponse:
        return target_pb2.TargetServiceInfoResponse(model_name="tiny", tokenizer_fingerprint=self.fingerprint,
                                                    active_sessions=4, queued_passes=1, max_context_len=99)

    async def release(self, session_id: str) -> bool:
        self.released.append(session_id)
        return True


class FakeDraft(FakeTarget):
    async def info(self, timeout: float) -> draft_pb2.DraftServiceInfoResponse:
        return draft_pb2.DraftServiceInfoResponse(proposer="ngram", active_sessions=2)


async def test_the_monitor_takes_members_back_reads_their_load_and_settles_owed_releases(tokenizer):
    model = ServedModel("tiny", tokenizer, 128)
    targets = Pool("target", "10.0.0.1:1,10.0.0.2:1", lambda a, _: FakeTarget(a, model.fingerprint))
    drafts = Pool("draft", "10.0.0.3:1", lambda a, _: FakeDraft(a, ""), breaker=DraftBreaker)
    monitor = UpstreamMonitor(targets, drafts, model)
    assert await monitor.check()
    one = targets.members["10.0.0.1:1"]
    assert (one.load, one.queued, model.max_context_len) == (5, 1, 99)
    assert drafts.members["10.0.0.3:1"].load == 2
    # A session saw the target hang: out of the pool, its session's release owed.
    targets.take_out(one, "hung")
    one.owed_releases.add("s1")
    one.client.up = False
    assert await monitor.check()  # the other target serves: still ready
    assert not one.usable and one.client.released == []
    one.client.up = True
    await monitor.check()
    assert one.usable and one.client.released == ["s1"] and not one.owed_releases
    # A member with another tokenizer is out, and says why.
    one.client.fingerprint = "0" * 32
    await monitor.check()
    assert not one.usable and "tokenizer mismatch" in one.detail
    for member in targets.members.values():
        member.client.up = False
    assert not await monitor.check()


async def test_the_monitor_checks_often_until_ready_then_at_its_interval(tokenizer):
    model = ServedModel("tiny", tokenizer, 128)
    targets = Pool("target", "10.0.0.1:1", lambda a, _: FakeTarget(a, model.fingerprint))
    drafts = Pool("draft", "10.0.0.3:1", lambda a, _: FakeDraft(a, ""), breaker=DraftBreaker)
    monitor = UpstreamMonitor(targets, drafts, model)
    target = targets.members["10.0.0.1:1"].client
    target.up = False  # still loading
    assert not await monitor.check()
    checks = []
    real_check = monitor.check

    async def counted_check() -> bool:
        checks.append(monitor.ready)
        if len(checks) == 3:
            target.up = True  # the target serves from the third check on
        return await real_check()

    monitor.check = counted_check
    watching = asyncio.create_task(monitor.watch(interval=60.0, waiting_interval=0.01))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if monitor.ready:
            break
    await asyncio.sleep(0.1)
    watching.cancel()
    assert monitor.ready  # within a few waiting intervals, not the 60 s interval
    assert len(checks) == 3  # and once ready, the next check waits for the interval

