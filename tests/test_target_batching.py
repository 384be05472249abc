"""Several sessions in one target forward pass (``target_service.ragged``), the engine's
``run_batch`` and the server's ``PassBatcher``: a batched pass gives every session what it would
get alone, on tiny random Llama and Gemma 3 (sliding window 8, contexts past it) targets."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import threading
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from kernels import hf_attention
from tandem.rpc.endpoints import insecure_channel
from tandem.telemetry.metrics import make_metrics
from tandem.models.worker import ModelWorker
from tandem.models import load_model
from tandem.cpu.screened_head import ScreenedArgmax
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service import kv_cache, ragged
from target_service.types import DraftBlock, GenerateResult, SparseDist, Verdict, VerdictStatus
from target_service.batcher import PassBatcher
from target_service.engine import DecodeStep, TargetEngine
from target_service.errors import InvalidArgument, SessionNotFound
from target_service.main import start_target
from target_service.session import SessionConfig


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return load_model(str(tiny_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def gemma(tiny_gemma_dir):
    return load_model(str(tiny_gemma_dir), device="cpu", dtype="float32")


@pytest.fixture(params=["llama", "gemma3"])
def target(request, llama, gemma):
    return llama if request.param == "llama" else gemma


def _tokens(seed: int, length: int) -> list[int]:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _filled_cache(model, tokens: list[int]):
    cache = kv_cache.new_cache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
    return cache


# --------------------------------------------------------------------------- ragged forward


@pytest.mark.parametrize("inner", ["sdpa", hf_attention.NAME_REFERENCE, hf_attention.NAME_TRITON])
def test_a_ragged_pass_equals_each_session_run_alone(target, inner, monkeypatch) -> None:
    """Contexts of 3 to 30 tokens (the Gemma window is 8) and 1 to 5 new tokens per session:
    logits, hidden states and the caches afterwards all equal separate forwards. ``inner`` is the
    wrapped attention: transformers' SDPA (masks given), and tandem's tree attention, its
    reference and its Triton kernel (interpreted here), which build their own masks (the kernel is
    what CUDA runs)."""
    model = target.model
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton consults it while launching, too
    if inner != "sdpa":
        hf_attention.install(model, inner)
    else:
        model.set_attn_implementation(inner)
    try:
        ragged.install(model)
        contexts = [_tokens(seed, length) for seed, length in enumerate((3, 30, 12, 9))]
        new = [_tokens(10 + seed, n) for seed, n in enumerate((1, 5, 2, 1))]
        alone_caches = [_filled_cache(model, ctx) for ctx in contexts]
        batch_caches = [_filled_cache(model, ctx) for ctx in contexts]
        alone = []
        with torch.inference_mode():
            for cache, ids in zip(alone_caches, new):
                out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, output_hidden_states=True)
                alone.append((out.logits[0], out.hidden_states[-1][0]))  # [n, vocab], [n, hidden]
            logits, hidden = ragged.forward(model, batch_caches, new, "cpu", want_hidden=True)
        for (want_logits, want_hidden), got_logits, got_hidden in zip(alone, logits, hidden):
            torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got_hidden, want_hidden, atol=1e-4, rtol=1e-4)
        for want, got in zip(alone_caches, batch_caches):
            assert kv_cache.cache_length(got) == kv_cache.cache_length(want)
            for layer_want, layer_got in zip(want.layers, got.layers):
                torch.testing.assert_close(layer_got.keys, layer_want.keys, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(layer_got.values, layer_want.values, atol=1e-5, rtol=1e-5)
    finally:
        model.set_attn_implementation("sdpa")


def test_ordinary_forwards_are_untouched_by_the_install(target) -> None:
    model = target.model
    model.set_attn_implementation("sdpa")
    tokens = _tokens(5, 20)
    with torch.inference_mode():
        before = model(input_ids=torch.tensor([tokens])).logits
        assert ragged.install(model) == ragged.PREFIX + "sdpa" == ragged.install(model)  # idempotent
        after = model(input_ids=torch.tensor([tokens])).logits
    assert torch.equal(before, after)


def test_a_model_whose_attention_cannot_be_wrapped_is_served_one_session_per_pass(llama) -> None:
    """Eager attention (its masks are additive, model by model) is left alone; run_batch still
    answers every call, running the sessions one after the other."""
    llama.model.set_attn_implementation("eager")
    try:
        assert ragged.install(llama.model) is None and llama.model.config._attn_implementation == "eager"
        engine, alone = _engine(llama), _engine(llama)
        assert not engine.runner.batched
        sessions = {"a": SessionConfig(max_new_tokens=6), "b": SessionConfig(max_new_tokens=6)}
        _start(engine, sessions)
        _start(alone, sessions)
        batch = engine.run_batch([DecodeStep("a"), DraftBlock("b", engine.store.get("b").committed_len, (5, 6))])
        assert _same(batch[0], alone.run_batch([DecodeStep("a")])[0])
        assert _same(batch[1], alone.run_batch([DraftBlock("b", alone.store.get("b").committed_len, (5, 6))])[0])
    finally:
        llama.model.set_attn_implementation("sdpa")


def test_a_ragged_forward_needs_the_install_and_tokens(llama) -> None:
    model = llama.model
    model.set_attn_implementation("sdpa")
    cache = _filled_cache(model, [5, 6, 7])
    with pytest.raises(RuntimeError, match="install"):
        ragged.forward(model, [cache], [[5]], "cpu")
    ragged.install(model)
    with pytest.raises(ValueError, match="at least one token"):
        ragged.forward(model, [cache, cache], [[5], []], "cpu")


# --------------------------------------------------------------------------- engine.run_batch


def _engine(loaded, **kwargs) -> TargetEngine:
    return TargetEngine(loaded, **kwargs)


def _start(engine: TargetEngine, sessions: dict[str, SessionConfig]) -> None:
    for i, (session_id, config) in enumerate(sessions.items()):
        engine.prefill(session_id, _tokens(20 + i, 6 + 5 * i), config)  # 6 to 26 tokens: past the window


def _calls(engine: TargetEngine, round_: int, session_ids) -> list:
    """A verify block (some drafts right, some wrong; a token tree for greedy sessions every other
    round), a sampled block with the draft's q, or a decode step for each session, depending on the
    round."""
    calls = []
    for i, session_id in enumerate(session_ids):
        session = engine.store.get(session_id)
        if session.finished:
            continue
        kind = (i + round_) % 3
        drafts = tuple(_tokens(100 * round_ + i, 1 + (i + round_) % 4))
        if kind == 0:
            calls.append(DecodeStep(session_id))
        elif session.config.temperature == 0 and round_ % 2 == 0 and len(drafts) > 1:
            # A token tree: two branches from the last committed token (siblings' tokens distinct).
            parents = (-1, 0, -1, 2)[: len(drafts)]
            if len(drafts) > 2 and drafts[2] == drafts[0]:
                drafts = (*drafts[:2], 3 + drafts[2] % 296, *drafts[3:])
            calls.append(
                DraftBlock(session_id, session.committed_len, drafts, block_id=round_, draft_parents=parents,
                           return_hidden_states=True)
            )
        elif kind == 1 or session.config.temperature == 0:
            calls.append(
                DraftBlock(session_id, session.committed_len, drafts, block_id=round_, return_hidden_states=True)
            )
        else:
            q = tuple(SparseDist((d, 7), (0.75, 0.25)) if d != 7 else SparseDist((7,), (1.0,)) for d in drafts)
            calls.append(DraftBlock(session_id, session.committed_len, drafts, draft_probs=q, block_id=round_))
    return calls


def _same(a: Verdict | GenerateResult, b: Verdict | GenerateResult) -> bool:
    if isinstance(a, GenerateResult):
        return a == b
    hidden_same = (a.hidden_states is None) == (b.hidden_states is None) and (
        a.hidden_states is None or torch.allclose(a.hidden_states, b.hidden_states, atol=1e-4)
    )
    fields = ("block_id", "status", "committed_len", "num_accepted", "committed_token_ids", "finish_reason")
    return hidden_same and all(getattr(a, f) == getattr(b, f) for f in fields)


def test_run_batch_answers_each_call_as_it_would_be_answered_alone(target) -> None:
    """Five sessions (greedy and seeded sampling) driven to their finish by mixed rounds of verify
    blocks and decode steps: batched, and one call at a time on a twin engine. Every answer, the
    committed tokens and the sampling randomness all match."""
    _check_run_batch_matches_alone(target)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_run_batch_through_the_tree_attention_kernel(tiny_gemma_dir) -> None:
    """On CUDA the ragged wrapper goes around the Triton tree-attention kernel (one call per session)."""
    loaded = load_model(str(tiny_gemma_dir), device="cuda", dtype="float32")
    assert TargetEngine(loaded).runner.attention == ragged.PREFIX + hf_attention.NAME
    _check_run_batch_matches_alone(loaded)


def test_screened_greedy_tokens_equal_the_float32_heads(target) -> None:
    """The same rounds with the batched engine's greedy sessions scored by a screened head (forced
    on: the tiny models' heads are below its size threshold), its twin by the float32 head: the
    same verdicts, steps and committed tokens, greedy sessions and sampled ones alike (those keep
    their logits in a pass shared with screened rows)."""
    _check_run_batch_matches_alone(target, screened=True)


def _check_run_batch_matches_alone(target, screened: bool = False) -> None:
    sessions = {
        "g1": SessionConfig(max_new_tokens=24, ignore_eos=True),
        "g2": SessionConfig(max_new_tokens=17, ignore_eos=True),
        "s1": SessionConfig(max_new_tokens=20, temperature=0.9, top_k=20, seed=1, ignore_eos=True),
        "s2": SessionConfig(max_new_tokens=22, temperature=1.2, top_p=0.9, seed=2, ignore_eos=True),
        "g3": SessionConfig(max_new_tokens=30, ignore_eos=True, return_hidden_states=True),
    }
    metrics = make_metrics("target")
    batched, alone = _engine(target, metrics=metrics), _engine(target)
    assert batched.runner.greedy_head is None  # a tiny head: below the screen's threshold
    screened_rows = []
    if screened:
        head = ScreenedArgmax(target.model.get_output_embeddings().weight.detach())
        batched.runner.greedy_head = lambda hidden: screened_rows.append(len(hidden)) or head(hidden)
    alone.runner.ragged_after = None  # the twin runs every call through transformers' own path
    _start(batched, sessions)
    _start(alone, sessions)
    prefills = metrics.registry.get_sample_value("tandem_target_pass_sessions_count")  # a pass each
    rounds = whole = 0
    while any(not batched.store.get(s).finished for s in sessions):
        rounds += 1
        calls = _calls(batched, rounds, sessions)
        assert calls == _calls(alone, rounds, sessions)
        answers = batched.run_batch(calls)
        owns = [alone.run_batch([call])[0] for call in calls]
        for call, answer, own in zip(calls, answers, owns):
            assert _same(answer, own), (rounds, call)
            assert not isinstance(answer, Verdict) or answer.status == VerdictStatus.OK
        # Each verdict names its pass: every session's rows, and the tokens the pass committed (a
        # block alone: its own rows, drafts past the session's budget left out, and tokens).
        for call, own in zip(calls, owns):
            if isinstance(own, Verdict):
                assert own.pass_tokens == len(own.committed_token_ids)
                assert 1 <= own.pass_rows <= 1 + len(call.draft_token_ids)
                whole += own.pass_rows == 1 + len(call.draft_token_ids)
        rows = sum(own.pass_rows if isinstance(own, Verdict) else 1 for own in owns)
        tokens = sum(len(a.committed_token_ids if isinstance(a, Verdict) else a.token_ids) for a in answers)
        assert all((a.pass_rows, a.pass_tokens) == (rows, tokens) for a in answers if isinstance(a, Verdict))
        for s in sessions:
            assert batched.store.get(s).tokens == alone.store.get(s).tokens
            if not batched.store.get(s).finished:  # the engine's invariant, for every session of the batch
                assert kv_cache.cache_length(batched.store.get(s).cache) == batched.store.get(s).committed_len - 1
    assert rounds >= 8 and whole > rounds
    assert (sum(screened_rows) > 3 * rounds) == screened  # greedy verify blocks and steps went through the screen
    passes = metrics.registry.get_sample_value("tandem_target_pass_sessions_count") - prefills
    sessions_in_passes = metrics.registry.get_sample_value("tandem_target_pass_sessions_sum") - prefills
    assert passes == rounds and sessions_in_passes > 2 * rounds


class _RowPrices:
    """Pass costs of a millisecond a row, whatever was measured."""

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def estimate(self, rows: float) -> float:
        return 0.001 * rows


def test_answers_name_what_a_step_of_every_live_session_costs(llama) -> None:
    """Verdicts and decode steps carry the target's price of a pass of one row per live session
    (the step the gateway weighs speculation against); a decode step also the pass it shared. No
    size measured yet: 0, not a guess. Passes are measured by their rows as they run."""
    engine = _engine(llama)
    sessions = {f"s{i}": SessionConfig(max_new_tokens=8, ignore_eos=True) for i in range(3)}
    _start(engine, sessions)
    steps = [engine.run_batch([DecodeStep("s0")])[0] for _ in range(3)]
    assert [step.step_seconds for step in steps[:2]] == [0.0, 0.0]  # one-row passes: too few to price
    assert all(step.pass_seconds > 0 for step in steps)
    assert set(engine.pass_costs.medians()) == {1}  # the prompts' passes (6, 11, 16 rows) once each
    assert steps[2].step_seconds == engine.pass_costs.medians()[1]  # three rows priced as the nearest size
    engine.pass_costs = _RowPrices()
    block = DraftBlock("s1", engine.store.get("s1").committed_len, draft_token_ids=(5, 6))
    verdict, step = engine.run_batch([block, DecodeStep("s2")])
    assert verdict.status is VerdictStatus.OK and verdict.pass_rows == 4
    assert verdict.step_seconds == pytest.approx(0.003) == step.step_seconds  # three live sessions, a row each
    assert step.pass_seconds > 0 and step.token_ids


def test_a_lone_step_past_the_sliding_window_takes_the_ragged_path_with_the_same_answers(gemma, llama, monkeypatch):
    """Past the window a session alone decodes and verifies through ``ragged.forward`` (its sliding
    layers then read only the window's keys); up to the window, for a long prompt chunk and for a
    model with no sliding layers it keeps transformers' path. Answers equal the ordinary path's."""
    ragged_rows = []
    real = ragged.forward

    def spy(model, caches, token_ids, *args, **kwargs):
        ragged_rows.append([len(ids) for ids in token_ids])
        return real(model, caches, token_ids, *args, **kwargs)

    monkeypatch.setattr(ragged, "forward", spy)
    engine, ordinary = _engine(gemma, prefill_chunk_tokens=0), _engine(gemma, prefill_chunk_tokens=0)
    ordinary.runner.ragged_after = None
    assert engine.runner.ragged_after == gemma.model.config.get_text_config().sliding_window == 8
    config = SessionConfig(max_new_tokens=40, ignore_eos=True, return_hidden_states=True)
    for e in (engine, ordinary):
        e.prefill("s", _tokens(3, 5), config)  # inside the window
    assert ragged_rows == []  # the prompt, and...
    assert engine.generate("s", 2) == ordinary.generate("s", 2)
    assert ragged_rows == []  # ...steps up to the window go the ordinary way
    for round_ in range(12):
        if round_ % 3 == 0:
            assert engine.generate("s", 1) == ordinary.generate("s", 1)
        else:
            session = engine.store.get("s")
            block = DraftBlock("s", session.committed_len, tuple(_tokens(round_, 1 + round_ % 4)), block_id=round_)
            assert _same(engine.verify(block), ordinary.verify(block))
        assert engine.store.get("s").tokens == ordinary.store.get("s").tokens
    assert len(ragged_rows) >= 10 and all(len(rows) == 1 for rows in ragged_rows)
    ragged_rows.clear()
    for e in (engine, ordinary):
        e.prefill("long", _tokens(4, 30), SessionConfig(max_new_tokens=4))  # one 30-token chunk
    assert ragged_rows == []
    assert _engine(llama).runner.ragged_after is None  # no sliding layers: nothing to gain


def test_prefill_chunks_share_passes_with_other_sessions_and_give_the_same_answers(target) -> None:
    """Three prompts prefilled in chunks of 4 (past the Gemma window of 8), hidden states asked for,
    while two sessions decode: each pass holds a chunk of every prompt and a step of every decoder.
    The prefill answers (first token, hidden states) and the decoders' tokens equal one call at a time."""
    decoders = {"d1": SessionConfig(max_new_tokens=30, ignore_eos=True), "d2": SessionConfig(max_new_tokens=30)}
    batched, alone = _engine(target, prefill_chunk_tokens=4), _engine(target, prefill_chunk_tokens=4)
    _start(batched, decoders)
    _start(alone, decoders)
    prompts = {f"p{i}": _tokens(60 + i, length) for i, length in enumerate((3, 10, 17))}
    config = SessionConfig(max_new_tokens=5, return_hidden_states=True, temperature=0.8, seed=3)
    jobs = {sid: batched.begin_prefill(sid, prompt, config) for sid, prompt in prompts.items()}
    twins = {sid: alone.begin_prefill(sid, prompt, config) for sid, prompt in prompts.items()}
    results: dict[str, object] = {}
    while len(results) < len(prompts):
        pending = [sid for sid in prompts if sid not in results]
        calls = [jobs[sid] for sid in pending] + [DecodeStep("d1"), DecodeStep("d2")]
        answers = batched.run_batch(calls)
        for sid, answer in zip(pending, answers):
            want = alone.run_batch([twins[sid]])[0]
            assert (answer is None) == (want is None)
            if answer is not None:
                assert (answer.token_id, answer.committed_len, answer.finish_reason) == (
                    want.token_id,
                    want.committed_len,
                    want.finish_reason,
                )
                torch.testing.assert_close(answer.hidden_states, want.hidden_states, atol=1e-4, rtol=1e-4)
                assert answer.hidden_states.shape[0] == len(prompts[sid])
                results[sid] = answer
        for decoder, answer in zip(("d1", "d2"), answers[len(pending) :]):
            assert answer == alone.run_batch([DecodeStep(decoder)])[0]
    assert batched.store.get("p2").tokens == alone.store.get("p2").tokens  # the sessions joined the store


def test_run_batch_keeps_each_calls_refusal_to_itself(llama) -> None:
    engine = _engine(llama)
    _start(engine, {"a": SessionConfig(max_new_tokens=8), "b": SessionConfig(max_new_tokens=8)})
    _start(engine, {"done": SessionConfig(max_new_tokens=1)})
    a = engine.store.get("a")
    answers = engine.run_batch(
        [
            DraftBlock("a", a.committed_len, (5, 6)),
            DraftBlock("b", 0, (5,)),  # stale: assumes an empty sequence
            DecodeStep("nobody"),
            DraftBlock("done", engine.store.get("done").committed_len, (5,)),
            DraftBlock("c", 3, (5,), draft_probs=(SparseDist((6,), (1.0,)),)),  # bad input, before any session lookup
        ]
    )
    assert answers[0].status == VerdictStatus.OK and len(answers[0].committed_token_ids) >= 1
    assert answers[1].status == VerdictStatus.STALE and answers[1].committed_len == engine.store.get("b").committed_len
    assert isinstance(answers[2], SessionNotFound)
    assert answers[3].status == VerdictStatus.FINISHED
    assert isinstance(answers[4], InvalidArgument)
    with pytest.raises(ValueError, match="one call per session"):
        engine.run_batch([DecodeStep("a"), DraftBlock("a", a.committed_len, (5,))])


def test_a_failed_batched_pass_fails_its_sessions_only(llama, monkeypatch) -> None:
    engine = _engine(llama)
    _start(engine, {session_id: SessionConfig(max_new_tokens=8) for session_id in ("a", "b", "c")})

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(ragged, "forward", out_of_memory)
        answers = engine.run_batch([DecodeStep("a"), DecodeStep("b")])
    assert all(isinstance(answer, RuntimeError) for answer in answers)
    for session_id in ("a", "b"):  # their caches may be half-written: they are gone
        with pytest.raises(SessionNotFound):
            engine.store.get(session_id)
    assert len(engine.generate("c", 2).token_ids) == 2


def test_a_step_whose_caller_left_during_the_pass_commits_nothing(llama) -> None:
    engine = _engine(llama)
    _start(engine, {"a": SessionConfig(max_new_tokens=8), "b": SessionConfig(max_new_tokens=8)})
    before = {s: list(engine.store.get(s).tokens) for s in ("a", "b")}
    gone, stays = engine.run_batch([DecodeStep("a", cancelled=lambda: True), DecodeStep("b")])
    assert gone.token_ids == () and engine.store.get("a").tokens == before["a"]
    assert kv_cache.cache_length(engine.store.get("a").cache) == len(before["a"]) - 1
    assert len(stays.token_ids) == 1 and engine.store.get("b").tokens[:-1] == before["b"]


# --------------------------------------------------------------------------- PassBatcher


class _Call:
    def __init__(self, session_id: str, name: str) -> None:
        self.session_id, self.name = session_id, name


async def test_the_batcher_groups_what_waits_one_call_per_session_within_the_token_budget() -> None:
    worker = ModelWorker("test")
    passes: list[list[str]] = []

    def run_batch(calls):
        passes.append([c.name for c in calls])
        return [ValueError(c.name) if c.name == "bad" else c.name.upper() for c in calls]

    batcher = PassBatcher(worker, run_batch, max_tokens=6)
    busy = threading.Event()
    blocker = asyncio.ensure_future(worker.run(busy.wait))  # the model is busy: calls pile up
    await asyncio.sleep(0.05)
    arrivals = [("a", "a1", 2), ("b", "b1", 3), ("a", "a2", 1), ("c", "c1", 2), ("d", "bad", 1), ("e", "e1", 1)]
    waits = [asyncio.ensure_future(batcher.run(_Call(s, name), rows)) for s, name, rows in arrivals]
    gone = asyncio.ensure_future(batcher.run(_Call("f", "f1"), 1))
    await asyncio.sleep(0.05)
    gone.cancel()  # its caller left before any pass
    with contextlib.suppress(asyncio.CancelledError):
        await gone  # the cancellation reaches the batcher's future on the loop, before the pass starts
    busy.set()
    await blocker
    answers = await asyncio.gather(*waits, return_exceptions=True)
    assert [a if isinstance(a, str) else f"error {a}" for a in answers] == ["A1", "B1", "A2", "C1", "error bad", "E1"]
    # Pass 1: a1 + b1 (5 tokens); a2 waits for a1; c1 (2) would pass the budget of 6, bad (1) fits.
    assert passes == [["a1", "b1", "bad"], ["a2", "c1", "e1"]]
    worker.shutdown()


async def test_a_lone_call_runs_at_once_and_a_batch_error_reaches_every_caller() -> None:
    worker = ModelWorker("test")

    def broken(calls):
        raise RuntimeError("bug")

    assert await PassBatcher(worker, lambda calls: [c.name for c in calls]).run(_Call("a", "x"), 1) == "x"
    batcher = PassBatcher(worker, broken)
    results = await asyncio.gather(
        batcher.run(_Call("a", "x"), 1), batcher.run(_Call("b", "y"), 1), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) for r in results)
    with pytest.raises(ValueError):
        PassBatcher(worker, broken, max_tokens=0)
    worker.shutdown()


# --------------------------------------------------------------------------- over gRPC


def _prefill(session_id: str, prompt: list[int], new: int) -> target_pb2.PrefillRequest:
    return target_pb2.PrefillRequest(
        session_id=session_id,
        prompt_token_ids=prompt,
        params=common_pb2.SessionParams(sampling=common_pb2.SamplingParams(), max_new_tokens=new, ignore_eos=True),
    )


async def test_concurrent_streams_share_passes_and_get_the_tokens_they_would_get_alone(llama) -> None:
    """Six Generate streams and two Verify streams at once: the passes hold several sessions, and
    every session's tokens equal those of the same requests one at a time."""
    prompts = [_tokens(40 + i, 5 + 3 * i) for i in range(8)]

    async def drive(stub, i: int) -> list[int]:
        session_id = uuid.uuid4().hex
        first = await stub.Prefill(_prefill(session_id, prompts[i], 12))
        tokens = [first.token_id]
        if i < 6:
            async for answer in stub.Generate(target_pb2.TargetServiceGenerateRequest(session_id=session_id)):
                tokens += answer.token_ids
        else:  # verify blocks of two (wrong) drafts each, one after the other
            length = first.committed_len
            while len(tokens) < 12:
                request = target_pb2.VerifyRequest(session_id=session_id, base_len=length, draft_token_ids=[7, 8])
                (verdict,) = [v async for v in stub.Verify(_one(request))]
                tokens += verdict.committed_token_ids
                length = verdict.committed_len
        await stub.Release(target_pb2.ReleaseRequest(session_id=session_id))
        return tokens

    results = {}
    for concurrent in (False, True):
        metrics = make_metrics("target")
        running = await start_target(TargetEngine(llama, metrics=metrics))
        try:
            async with insecure_channel(f"127.0.0.1:{running.port}") as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                if concurrent:
                    results[concurrent] = await asyncio.gather(*(drive(stub, i) for i in range(8)))
                else:
                    results[concurrent] = [await drive(stub, i) for i in range(8)]
        finally:
            await running.stop()
        passes = metrics.registry.get_sample_value("tandem_target_pass_sessions_count")
        sessions = metrics.registry.get_sample_value("tandem_target_pass_sessions_sum")
        if concurrent:
            assert sessions / passes > 2  # most passes were shared
        else:
            assert sessions == passes  # one session per pass
    assert results[True] == results[False]
    assert all(len(tokens) == 12 for tokens in results[True])


async def _one(request):
    yield request


async def test_an_unknown_session_in_a_shared_pass_is_refused_alone(llama) -> None:
    running = await start_target(TargetEngine(llama))
    try:
        async with insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            good = uuid.uuid4().hex
            await stub.Prefill(_prefill(good, _tokens(1, 6), 30))

            async def unknown():
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    async for _ in stub.Generate(target_pb2.TargetServiceGenerateRequest(session_id="nobody")):
                        pass
                return error.value.code()

            async def fine():
                return [
                    t
                    async for a in stub.Generate(target_pb2.TargetServiceGenerateRequest(session_id=good))
                    for t in a.token_ids
                ]

            code, tokens = await asyncio.gather(unknown(), fine())
            assert code == grpc.StatusCode.NOT_FOUND and len(tokens) == 29
    finally:
        await running.stop()


# --------------------------------------------------------------------------- benchmarks/batched_passes.py


def test_the_batched_passes_benchmark_runs_and_leaves_the_caches_as_they_were(tiny_dir, capsys) -> None:
    spec = importlib.util.spec_from_file_location(
        "batched_passes", Path(__file__).resolve().parent.parent / "benchmarks" / "batched_passes.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(
        ["--model", str(tiny_dir), "--sessions", "1", "3", "--rows", "1", "2", "--repeats", "2", "--context", "9"]
    )
    assert [(r["sessions"], r["rows"]) for r in results] == [(1, 1), (3, 1), (1, 2), (3, 2)]
    assert all(r["batched_s"] > 0 and r["separate_s"] > 0 for r in results)
    assert "gain" in capsys.readouterr().out
