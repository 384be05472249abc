"""SessionStore: ids, the live-session cap, finishing, idempotent release and TTL expiry."""

from __future__ import annotations

import pytest
import torch

from target_service.errors import InvalidArgument, SessionExists, SessionNotFound, TooManySessions
from target_service.types import FinishReason
from target_service.session import SamplingTensors, Session, SessionConfig, SessionStore, make_generator


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _session(session_id: str) -> Session:
    config = SessionConfig(max_new_tokens=4)
    return Session(
        session_id=session_id,
        config=config,
        prompt_len=2,
        tokens=[5, 6, 7],
        cache=None,
        generator=make_generator(0, "cpu"),
        sampling=SamplingTensors.of(config, "cpu"),
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def live_counts() -> list[int]:
    return []


@pytest.fixture
def store(clock, live_counts) -> SessionStore:
    return SessionStore(ttl_s=10.0, max_live=2, clock=clock, on_live_change=live_counts.append)


def test_add_get_and_duplicate_ids(store) -> None:
    store.add(_session("a"))
    assert store.get("a").tokens == [5, 6, 7]
    with pytest.raises(SessionExists):
        store.add(_session("a"))
    with pytest.raises(SessionNotFound):
        store.get("nope")


def test_live_cap_counts_only_unfinished_sessions(store, live_counts) -> None:
    store.add(_session("a"))
    store.add(_session("b"))
    with pytest.raises(TooManySessions):
        store.add(_session("c"))
    store.finish(store.get("a"), FinishReason.STOP)
    store.add(_session("c"))  # a finished session keeps its record but not its slot
    assert store.get("a").finished and len(store) == 3 and store.live == 2
    assert live_counts == [1, 2, 1, 2]


def test_release_is_idempotent(store, live_counts) -> None:
    store.add(_session("a"))
    assert store.release("a") is True
    assert store.release("a") is False
    assert store.release("never") is False
    assert live_counts == [1, 0]


def test_idle_sessions_expire_and_use_keeps_them_alive(store, clock, live_counts) -> None:
    store.add(_session("idle"))
    store.add(_session("busy"))
    for _ in range(3):
        clock.now += 6.0
        store.get("busy")  # used every 6 s: never idle for 10 s
    assert store.expire_idle() == ["idle"]
    assert live_counts[-1] == 1
    with pytest.raises(SessionNotFound):
        store.get("idle")
    clock.now += 10.5
    with pytest.raises(SessionNotFound):  # expiry also happens on access, before the reaper runs
        store.get("busy")
    assert store.release("busy") is False and store.live == 0


def test_seeded_generators_repeat() -> None:
    a, b = make_generator(42, "cpu"), make_generator(42, "cpu")
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    fresh = [torch.rand(3, generator=make_generator(None, "cpu")) for _ in range(2)]
    assert not torch.equal(*fresh)


def test_kv_budget_reserves_prompt_and_max_new_tokens_until_finish_release_or_expiry(clock) -> None:
    # _session: a prompt of 2 and max_new_tokens 4 reserve 6 positions
    store = SessionStore(ttl_s=10.0, max_live=10, clock=clock, kv_budget_tokens=13)
    store.add(_session("a"))
    store.add(_session("b"))
    assert store.reserved_kv_tokens == 12
    with pytest.raises(TooManySessions, match="KV cache budget"):
        store.add(_session("c"))
    store.finish(store.get("a"), FinishReason.LENGTH)  # its cache is gone
    store.add(_session("c"))
    store.release("b")
    store.release("a")  # finished already: gives back nothing twice
    assert store.reserved_kv_tokens == 6
    clock.now += 11  # c expires
    store.add(_session("d"))
    assert store.reserved_kv_tokens == 6 and store.live == 1


def test_a_session_larger_than_the_whole_kv_budget_is_invalid_not_busy(clock) -> None:
    store = SessionStore(ttl_s=10.0, max_live=10, clock=clock, kv_budget_tokens=5)
    with pytest.raises(InvalidArgument, match="more than the target's whole budget"):
        store.add(_session("a"))
    assert store.reserved_kv_tokens == 0 and store.live == 0


def test_free_memory_is_a_positive_byte_count_on_this_host() -> None:
    from target_service.kv_cache import free_memory_bytes

    assert 2**26 < free_memory_bytes("cpu") < 2**50
