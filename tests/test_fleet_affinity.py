"""Placement by cached prefix (gateway.prefix_affinity): the next turn of a conversation goes to the
target that served the last, unless that target is much busier; with fakes, no sockets."""

from __future__ import annotations

import dataclasses

from gateway.pool import Pool
from gateway.prefix_affinity import PrefixAffinity
from gateway.request import Speculation
from gateway_fakes import InMemoryTarget, ScriptedModel
from test_fleet_failover import make_deps, make_request, run
from tandem.token_blocks import BLOCK, block_hashes
from test_fleet_pool import Client

SYSTEM = list(range(100, 100 + 3 * BLOCK))  # three whole blocks


def pool_of(*names: str) -> Pool:
    return Pool.of("target", {f"{n}:1": Client(n) for n in names})


def test_a_prompt_goes_where_its_longest_prefix_is_held():
    pool, affinity = pool_of("a", "b", "c"), PrefixAffinity()
    affinity.remember("b:1", SYSTEM[: 2 * BLOCK])
    affinity.remember("c:1", SYSTEM + [1, 2, 3])
    for _ in range(3):  # every time, whatever round-robin's turn
        placement = pool.place(prefer=affinity.narrower(SYSTEM + [7] * 40))
        assert placement.address == "c:1"
        placement.close()
    assert affinity.held("c:1", block_hashes(SYSTEM + [7])) == 3 * BLOCK
    assert affinity.held("b:1", block_hashes(SYSTEM)) == 2 * BLOCK


def test_without_a_known_prefix_placement_is_by_load_alone():
    pool, affinity = pool_of("a", "b"), PrefixAffinity()
    affinity.remember("a:1", SYSTEM)
    placed = [pool.place(prefer=affinity.narrower([9] * 50)) for _ in range(2)]
    assert sorted(p.address for p in placed) == ["a:1", "b:1"]  # spread: nothing held anywhere
    short = pool.place(prefer=affinity.narrower(SYSTEM[: BLOCK - 1]))  # not one whole block
    assert short is not None


def test_a_much_busier_holder_is_passed_over():
    pool, affinity = pool_of("a", "b"), PrefixAffinity()
    affinity.remember("a:1", SYSTEM)
    busy = [pool.place(prefer=lambda members: [m for m in members if m.address == "a:1"]) for _ in range(3)]
    assert all(p.address == "a:1" for p in busy)  # a: 3 sessions, b: none
    assert pool.place(prefer=affinity.narrower(SYSTEM + [5])).address == "b:1"  # 3 > 2 * 0 + 1
    assert pool.place(prefer=affinity.narrower(SYSTEM + [5])).address == "a:1"  # 3 <= 2 * 1 + 1


def test_what_is_remembered_is_bounded_and_forgotten_with_its_target():
    affinity = PrefixAffinity(max_blocks=4)
    affinity.remember("a:1", SYSTEM)  # 3 blocks
    affinity.remember("a:1", [1] * (2 * BLOCK))  # 2 more: the oldest of the first goes
    assert affinity.held("a:1", block_hashes(SYSTEM)) == 0
    assert affinity.held("a:1", block_hashes([1] * (2 * BLOCK))) == 2 * BLOCK
    affinity.forget("a:1")
    assert affinity.held("a:1", block_hashes([1] * (2 * BLOCK))) == 0


async def test_the_next_turn_of_a_conversation_goes_to_the_target_that_served_the_last(tokenizer):
    """Two in-memory targets behind a gateway: each turn's prompt is the last one's plus its answer
    and a new message; every turn lands where the first did (by load alone, idle targets take turns)."""
    a, b = ScriptedModel(tokenizer), ScriptedModel(tokenizer)
    deps = make_deps(tokenizer, {"a:1": InMemoryTarget(a), "b:1": InMemoryTarget(b)}, {})
    request = make_request(tokenizer, Speculation.OFF)
    prompt = list(range(3, 3 + 2 * BLOCK))

    def prefills() -> list[int]:
        return [sum(rpc == "Prefill" for rpc, _ in model.rpcs) for model in (a, b)]

    for turn in range(4):
        tokens, _ = await run(deps, dataclasses.replace(request, prompt_token_ids=tuple(prompt)))
        assert sorted(prefills()) == [0, turn + 1]
        prompt = prompt + tokens + [5, 6]
    for start in (200, 250):  # prompts no target holds: by load (idle targets take turns)
        await run(deps, dataclasses.replace(request, prompt_token_ids=tuple(range(start, start + 2 * BLOCK))))
    assert sorted(prefills()) == [1, 5]
