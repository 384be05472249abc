"""The target's prefix cache: a prompt that starts as an ended session's tokens did prefills only
the rest and decodes what a whole prefill would; kept caches yield to live sessions' budget; what
is never kept. On a tiny Gemma 3 computing on GGUF blocks (row-exact passes: equal to the bit) and
on tiny float32 targets."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.models import load_model
from tandem.telemetry.metrics import make_metrics
from target_service import kv_cache
from target_service.engine import TargetEngine
from tandem.token_blocks import BLOCK
from target_service.prefix_cache import MIN_TOKENS, PrefixCache
from target_service.session import SessionConfig
from target_service.types import DraftBlock, VerdictStatus
from test_quant_model import quantized_gemma  # noqa: F401 (a fixture)
from test_target_engine import _prompt as prompt_ids

CONFIG = SessionConfig(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def float_gemma(tiny_gemma_dir):
    return load_model(str(tiny_gemma_dir), device="cpu", dtype="float32")


def turn(engine: TargetEngine, session_id: str, prompt: list[int], config: SessionConfig = CONFIG) -> tuple:
    """Prefill and decode to the budget; the session's generated tokens and how many prompt tokens came cached."""
    first = engine.prefill(session_id, prompt, config)
    rest = engine.generate(session_id, config.max_new_tokens - 1)
    return [first.token_id, *rest.token_ids], first.cached_tokens


def speculated_turn(engine: TargetEngine, session_id: str, prompt: list[int], seed: int) -> list[int]:
    """To the budget through verify blocks of random drafts: the last pass writes rejected drafts past the end."""
    rng = random.Random(seed)
    first = engine.prefill(session_id, prompt, CONFIG)
    tokens = [first.token_id]
    while len(tokens) < CONFIG.max_new_tokens:
        verdict = engine.verify(DraftBlock(session_id, len(prompt) + len(tokens), tuple(rng.randrange(300) for _ in range(4))))
        assert verdict.status is VerdictStatus.OK
        tokens += verdict.committed_token_ids
    return tokens


def test_the_next_turn_of_a_conversation_prefills_only_what_is_new(quantized_gemma) -> None:
    cached_engine, fresh_engine = TargetEngine(quantized_gemma), TargetEngine(quantized_gemma, prefix_cache=False)
    metrics = make_metrics("target")
    cached_engine.metrics = metrics
    prompt = prompt_ids(1, 40)
    for t in range(3):
        answer, cached = turn(cached_engine, f"turn{t}", prompt)
        expected, none = turn(fresh_engine, f"turn{t}", prompt)
        assert answer == expected and none == 0  # to the bit: the passes are row-exact
        # Turn 0 had nothing to start from; later turns start from the whole last turn but its last token.
        assert cached == (0 if t == 0 else previous_len - 1)
        cached_engine.release(f"turn{t}")
        fresh_engine.release(f"turn{t}")
        previous_len = len(prompt) + len(answer)
        prompt = prompt + answer + prompt_ids(10 + t, 6)  # the next message
    assert len(cached_engine.store.prefix_cache) == 1  # each turn's entry replaced the one it extends
    hits = metrics.registry.get_sample_value("tandem_target_prompt_tokens_total", {"outcome": "hit"})
    assert hits == sum((40 + 12 - 1, 40 + 12 + 6 + 12 - 1))


@pytest.mark.parametrize("finish", ["released", "finished"])
def test_a_speculated_session_leaves_only_its_committed_tokens(quantized_gemma, finish) -> None:
    """Its last verify pass wrote drafts the verdict rejected: they are cut off before the cache is kept."""
    engine, fresh = TargetEngine(quantized_gemma), TargetEngine(quantized_gemma, prefix_cache=False)
    prompt = prompt_ids(2, 30)
    if finish == "finished":
        answer = speculated_turn(engine, "a", prompt, seed=1)
        assert engine.store.get("a").finished
    else:
        engine.prefill("a", prompt, CONFIG)
        verdict = engine.verify(DraftBlock("a", len(prompt) + 1, (7, 8, 9)))
        answer = [engine.store.get("a").tokens[len(prompt)], *verdict.committed_token_ids]
        engine.release("a")
    follow_up = prompt + answer + [5, 6, 7]
    assert turn(engine, "b", follow_up)[0] == turn(fresh, "b", follow_up)[0]


def test_sessions_sharing_a_system_prompt_each_get_a_copy(float_gemma) -> None:
    engine = TargetEngine(float_gemma)
    system = prompt_ids(3, 32)
    turn(engine, "first", system + [11, 12])
    engine.release("first")
    caches = []
    for name, question in (("x", [21, 22, 23]), ("y", [31, 32])):
        first = engine.prefill(name, system + question, CONFIG)
        assert first.cached_tokens == 32  # the shared part, not the first session's question
        caches.append(engine.store.get(name).cache)
    assert caches[0] is not caches[1] and len(engine.store.prefix_cache) == 1
    # Float32 passes: a cached prefix differs from a whole prefill by summation order only.
    reference = TargetEngine(float_gemma, prefix_cache=False)
    reference.prefill("x", system + [21, 22, 23], CONFIG)
    for a, b in zip(caches[0].layers, reference.store.get("x").cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)


def test_kept_caches_give_way_to_live_sessions(float_gemma) -> None:
    """A budget of 2400 positions (kept caches: at most a quarter): a kept cache never makes a
    session that fits the budget wait."""
    per_position = kv_cache.bytes_per_position(float_gemma.model.config.get_text_config(), torch.float32)
    engine = TargetEngine(float_gemma, kv_cache_bytes=2400 * per_position)
    turn(engine, "a", prompt_ids(4, 300))
    engine.release("a")
    assert len(engine.store.prefix_cache) == 1
    assert 311 <= engine.store.prefix_cache.positions <= 311 + kv_cache.SPARE_POSITIONS  # its buffers' room
    engine.prefill("big", prompt_ids(5, 1900), CONFIG)  # 1912 positions reserved: the entry must go
    assert len(engine.store.prefix_cache) == 0 and engine.store.prefix_cache.positions == 0
    assert engine.store.reserved_kv_tokens == 1912


def test_what_is_never_kept_or_reused(float_gemma) -> None:
    engine = TargetEngine(float_gemma)
    short = prompt_ids(6, MIN_TOKENS - 4)
    turn(engine, "short", short)  # 8 + 12 - 1 positions: under MIN_TOKENS... of prompt and answer together
    engine.release("short")
    assert len(engine.store.prefix_cache) == (1 if len(short) + CONFIG.max_new_tokens - 1 >= MIN_TOKENS else 0)
    prompt = prompt_ids(7, 40)
    engine.prefill("broken", prompt, CONFIG)
    engine._drop(engine.store.get("broken"))  # as after a failed pass: its cache may be half-written
    assert engine.prefill("again", prompt, CONFIG).cached_tokens == 0
    engine.release("again")
    hidden = engine.prefill("hidden", prompt, SessionConfig(max_new_tokens=4, return_hidden_states=True))
    assert hidden.cached_tokens == 0 and hidden.hidden_states.shape[0] == len(prompt)
    off = TargetEngine(float_gemma, prefix_cache=False)
    turn(off, "a", prompt)
    off.release("a")
    assert off.prefill("b", prompt, CONFIG).cached_tokens == 0 and off.store.prefix_cache is None


def test_the_longest_prefix_wins_and_the_least_recent_goes_first() -> None:
    pool = PrefixCache(max_positions=10_000)
    base = list(range(1000, 1000 + BLOCK))  # one block both entries share

    def cache_of(n: int):
        cache = kv_cache.new_cache()
        cache.update(torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4), 0)
        return cache

    pool.keep(base + [1] * BLOCK + [5], cache_of(2 * BLOCK + 1), room=None)  # keeps two whole blocks
    pool.keep(base + [2] * (BLOCK + 4) + [6], cache_of(2 * BLOCK + 5), room=None)  # two blocks and 4 tokens
    assert pool.lookup(base + [1] * BLOCK + [7])[1] == 2 * BLOCK
    assert pool.lookup(base + [2] * (BLOCK + 4) + [8, 8])[1] == 2 * BLOCK + 4  # past its last whole block
    assert pool.lookup(base + [2] * 10)[1] == BLOCK + 9  # the prompt's last token is left to prefill
    assert pool.lookup([7] * 40) is None and pool.lookup(base[:10]) is None  # no whole block in common
    pool.shrink_to(pool.positions - 1)  # the least recently used (the first, looked up before) goes
    assert len(pool) == 1 and pool.lookup(base + [1] * BLOCK + [7])[1] == BLOCK
    pool.keep(base + [2] * (BLOCK + 4) + [6, 6, 6], cache_of(2 * BLOCK + 7), room=None)  # extends the other
    assert len(pool) == 1 and pool.lookup(base + [2] * (BLOCK + 4) + [6, 6, 9])[1] == 2 * BLOCK + 6


def test_a_prompt_starts_from_a_live_sessions_cache(quantized_gemma) -> None:
    """A request's other choices, prefilled while the first is live (and decoding, and speculating):
    each starts from a copy of its cache and decodes what a whole prefill would, to the bit."""
    engine, fresh = TargetEngine(quantized_gemma), TargetEngine(quantized_gemma, prefix_cache=False)
    prompt = prompt_ids(3, 50)
    first = engine.prefill("first", prompt, CONFIG)
    assert first.cached_tokens == 0
    engine.verify(DraftBlock("first", len(prompt) + 1, (7, 8, 9)))  # it moves on, drafts rejected past its end
    second, cached = turn(engine, "second", prompt)
    assert cached == len(prompt) - 1  # all but the last prompt token, from the live session
    assert second == turn(fresh, "second", prompt)[0]
    longer = prompt + prompt_ids(4, 20)
    third, cached = turn(engine, "third", longer)  # "second" has ended: its whole prompt and answer are kept
    assert cached >= len(prompt) - 1 and third == turn(fresh, "third", longer)[0]
    other = prompt_ids(5, 50)
    assert turn(engine, "other", other)[1] == 0  # nothing shared
    off = TargetEngine(quantized_gemma, prefix_cache=False)
    off.prefill("a", prompt, CONFIG)
    assert off.prefill("b", prompt, CONFIG).cached_tokens == 0  # --no-prefix-cache: every prompt whole
