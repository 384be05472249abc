"""TargetEngine without gRPC: greedy losslessness, the stale-block protocol, finishing, TTL,
hidden states and metrics, on tiny random Llama and Gemma 3 (sliding window 8) targets."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from tandem.telemetry.metrics import make_metrics
from tandem.models import load_model
from tandem.cpu.screened_head import ScreenedArgmax
from target_service import kv_cache
from target_service.types import DraftBlock, FinishReason, SparseDist, VerdictStatus
from target_service.engine import TargetEngine
from target_service.errors import InvalidArgument, SessionExists, SessionNotFound, TokenizerMismatch, TooManySessions
from target_service.session import SessionConfig

STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH
PROMPT_LEN = 20  # longer than the tiny Gemma's sliding window (8)
NEW_TOKENS = 40

Drafter = Callable[[list[int], int], list[int]]


@pytest.fixture(scope="module")
def draft_model(tiny_draft_dir):
    return load_model(str(tiny_draft_dir), device="cpu", dtype="float32").model


def _prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy decoding, without stopping at EOS."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def greedy(max_new_tokens: int = NEW_TOKENS, **kwargs) -> SessionConfig:
    return SessionConfig(max_new_tokens=max_new_tokens, ignore_eos=True, **kwargs)


def speculate(engine: TargetEngine, session_id: str, drafter: Drafter, k: int, generate_every: int = 0) -> list[int]:
    """Drives a session to its finish with draft blocks (and some Generate calls); returns the
    generated tokens, checking the verdict invariants on the way."""
    session = engine.store.get(session_id)
    rounds = 0
    while not session.finished:
        rounds += 1
        if generate_every and rounds % generate_every == 0:
            result = engine.generate(session_id, 2)
            assert result.committed_len == session.committed_len
            continue
        before = session.committed_len
        drafts = drafter(list(session.tokens), k)
        verdict = engine.verify(DraftBlock(session_id, before, tuple(drafts), block_id=rounds))
        assert verdict.status == VerdictStatus.OK and verdict.block_id == rounds
        assert list(verdict.committed_token_ids[: verdict.num_accepted]) == drafts[: verdict.num_accepted]
        assert verdict.committed_len == before + len(verdict.committed_token_ids) == session.committed_len
        if not session.finished:
            assert len(verdict.committed_token_ids) == verdict.num_accepted + 1
            assert session.cache.get_seq_length() == session.committed_len - 1  # the engine's invariant
    return session.tokens[session.prompt_len :]


def random_drafter(seed: int) -> Drafter:
    rng = random.Random(seed)
    return lambda tokens, k: [rng.randrange(300) for _ in range(rng.randint(0, k))]


def oracle_drafter(prompt: list[int], reference: list[int]) -> Drafter:
    """The target's own greedy continuation: every block is fully accepted."""
    return lambda tokens, k: reference[len(tokens) - len(prompt) :][:k]


def model_drafter(model) -> Drafter:
    """A second tiny model's greedy continuation (different weights: partial acceptance)."""

    @torch.inference_mode()
    def draft(tokens: list[int], k: int) -> list[int]:
        out = model.generate(torch.tensor([tokens]), max_new_tokens=k, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(tokens) :].tolist()

    return draft


# --------------------------------------------------------------------------- greedy losslessness


@pytest.mark.parametrize("drafter_kind", ["random", "draft-model", "oracle"])
def test_greedy_verify_equals_transformers_generate(llama_or_gemma, draft_model, drafter_kind) -> None:
    engine = TargetEngine(llama_or_gemma)
    prompt = _prompt(0)
    reference = hf_greedy(llama_or_gemma.model, prompt, NEW_TOKENS)
    drafter = {
        "random": random_drafter(1),
        "draft-model": model_drafter(draft_model),
        "oracle": oracle_drafter(prompt, reference),
    }[drafter_kind]
    first = engine.prefill("s", prompt, greedy())
    assert first.token_id == reference[0] and first.committed_len == PROMPT_LEN + 1
    assert speculate(engine, "s", drafter, k=4) == reference
    assert engine.store.get("s").finish_reason == LENGTH


@pytest.mark.parametrize("screened", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 7, PROMPT_LEN, 0])
def test_chunked_prefill_equals_one_pass_and_transformers(llama_or_gemma, chunk, screened) -> None:
    """Chunks of any size (across the tiny Gemma's sliding window of 8, and one token at a time)
    give the same first token, prompt hidden states and greedy continuation as one pass, with
    the float32 LM head and with a screened one (forced on: the tiny heads are below its size
    threshold; chunks before the last are scored by neither)."""
    prompt = _prompt(3)
    reference = hf_greedy(llama_or_gemma.model, prompt, NEW_TOKENS)
    whole = TargetEngine(llama_or_gemma, prefill_chunk_tokens=0).prefill("s", prompt, greedy(return_hidden_states=True))
    engine = TargetEngine(llama_or_gemma, prefill_chunk_tokens=chunk)
    if screened:
        engine.runner.greedy_head = ScreenedArgmax(llama_or_gemma.model.get_output_embeddings().weight.detach())
    first = engine.prefill("s", prompt, greedy(return_hidden_states=True))
    assert (first.token_id, first.committed_len) == (reference[0], PROMPT_LEN + 1)
    torch.testing.assert_close(first.hidden_states, whole.hidden_states, atol=1e-4, rtol=1e-4)
    assert engine.store.get("s").cache.get_seq_length() == PROMPT_LEN  # the engine's invariant
    assert speculate(engine, "s", random_drafter(4), k=3) == reference


def test_a_prefill_in_chunks_lets_other_sessions_decode_in_between(llama) -> None:
    """Each chunk is its own call; the session is not in the store (nor counted) until the last."""
    engine = TargetEngine(llama, prefill_chunk_tokens=6)
    other = _prompt(5)
    reference = hf_greedy(llama.model, other, 6)
    engine.prefill("other", other, greedy(6))
    job = engine.begin_prefill("long", _prompt(6), greedy())
    results, generated = [], []
    while not results or results[-1] is None:
        results.append(engine.prefill_chunk(job))
        if results[-1] is None:
            assert engine.store.live == 1
            with pytest.raises(SessionNotFound):
                engine.store.get("long")
        if not engine.store.get("other").finished:
            generated += engine.generate("other", 1).token_ids
    assert len(results) == 4  # 20 prompt tokens in chunks of 6
    assert [reference[0], *generated] == reference[: 1 + len(generated)] and len(generated) == 4
    assert engine.store.live == 2 and engine.store.get("long").committed_len == PROMPT_LEN + 1


def test_a_session_id_taken_while_a_prefill_ran_is_refused_at_its_end(llama) -> None:
    engine = TargetEngine(llama, prefill_chunk_tokens=8)
    job = engine.begin_prefill("s", _prompt(7), greedy())
    assert engine.prefill_chunk(job) is None
    engine.prefill("s", _prompt(8), greedy())
    with pytest.raises(SessionExists):
        while engine.prefill_chunk(job) is None:
            pass
    assert engine.store.live == 1


def test_kv_budget_in_positions_matches_what_a_cache_really_holds(llama_or_gemma) -> None:
    """The budget's bytes per position are what a session's cache takes (full history on every
    layer, the tiny Gemma's sliding layers included), and prefills past the budget are refused."""
    per_position = kv_cache.bytes_per_position(llama_or_gemma.model.config.get_text_config(), torch.float32)
    engine = TargetEngine(llama_or_gemma, kv_cache_bytes=per_position * (2 * (PROMPT_LEN + NEW_TOKENS) + 5))
    engine.prefill("a", _prompt(20), greedy())
    cache = engine.store.get("a").cache
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == per_position * PROMPT_LEN
    engine.prefill("b", _prompt(21), greedy())
    with pytest.raises(TooManySessions, match="KV cache budget"):
        engine.prefill("c", _prompt(22), greedy())
    with pytest.raises(InvalidArgument, match="whole budget"):
        engine.prefill("huge", _prompt(23), greedy(2000))
    engine.release("a")
    assert engine.prefill("c", _prompt(22), greedy()).committed_len == PROMPT_LEN + 1


def test_oracle_blocks_are_fully_accepted(llama) -> None:
    engine = TargetEngine(llama)
    prompt = _prompt(1)
    reference = hf_greedy(llama.model, prompt, 16)
    engine.prefill("s", prompt, greedy(16))
    verdict = engine.verify(DraftBlock("s", PROMPT_LEN + 1, tuple(reference[1:6])))
    assert verdict.num_accepted == 5 and list(verdict.committed_token_ids) == reference[1:7]


def test_mixed_verify_and_generate_in_one_session(llama_or_gemma, draft_model) -> None:
    engine = TargetEngine(llama_or_gemma)
    prompt = _prompt(2)
    engine.prefill("s", prompt, greedy())
    tokens = speculate(engine, "s", model_drafter(draft_model), k=3, generate_every=2)
    assert tokens == hf_greedy(llama_or_gemma.model, prompt, NEW_TOKENS)


def test_generate_alone_equals_transformers_generate(llama_or_gemma) -> None:
    engine = TargetEngine(llama_or_gemma)
    prompt = _prompt(3)
    engine.prefill("s", prompt, greedy(12))
    result = engine.generate("s", 100)  # capped by the session's budget
    assert result.finish_reason == LENGTH and result.committed_len == PROMPT_LEN + 12
    assert engine.store.get("s").tokens[PROMPT_LEN:] == hf_greedy(llama_or_gemma.model, prompt, 12)


# --------------------------------------------------------------------------- protocol


def test_stale_blocks_leave_the_session_untouched(llama) -> None:
    engine = TargetEngine(llama)
    prompt = _prompt(4)
    reference = hf_greedy(llama.model, prompt, NEW_TOKENS)
    engine.prefill("s", prompt, greedy())
    engine.verify(DraftBlock("s", PROMPT_LEN + 1, tuple(reference[1:4])))  # commits 4 tokens
    session = engine.store.get("s")
    committed, cache_len = list(session.tokens), session.cache.get_seq_length()
    n = len(committed)
    drafts = tuple(reference[n - PROMPT_LEN : n - PROMPT_LEN + 3])
    # base_len past the end is no stale view but a broken drafter: refused, the session untouched.
    with pytest.raises(InvalidArgument, match="base_len"):
        engine.verify(DraftBlock("s", n + 1, drafts))
    assert session.tokens == committed and session.cache.get_seq_length() == cache_len
    stale_blocks = [
        DraftBlock("s", n - 1, drafts),  # base_len short, nothing assumed
        DraftBlock("s", n - 2, drafts, assumed_token_ids=(committed[-2], committed[-1] + 1)),  # wrong assumption
        DraftBlock("s", n - 1, drafts, assumed_token_ids=(committed[-1], 7)),  # assumes a token not committed
    ]
    for block in stale_blocks:
        verdict = engine.verify(block)
        assert (verdict.status, verdict.committed_len, verdict.committed_token_ids) == (VerdictStatus.STALE, n, ())
        assert session.tokens == committed and session.cache.get_seq_length() == cache_len
    # A pipelined block naming the right assumed tokens is verified as usual.
    verdict = engine.verify(DraftBlock("s", n - 2, drafts, assumed_token_ids=tuple(committed[-2:])))
    assert verdict.status == VerdictStatus.OK and verdict.num_accepted == 3
    engine.generate("s", 100)
    assert session.tokens[PROMPT_LEN:] == reference


def test_stop_token_cuts_the_verdict_and_finishes(llama) -> None:
    engine = TargetEngine(llama)
    prompt = _prompt(5)
    reference = hf_greedy(llama.model, prompt, NEW_TOKENS)
    stop = reference[3]
    end = reference.index(stop) + 1
    engine.prefill("s", prompt, greedy(stop_token_ids=(stop,)))
    verdict = engine.verify(DraftBlock("s", PROMPT_LEN + 1, tuple(reference[1:8])))
    assert verdict.finish_reason == STOP
    assert list(verdict.committed_token_ids) == reference[1:end]  # the stop token included, nothing after
    assert verdict.num_accepted == len(verdict.committed_token_ids)  # all of them were draft tokens
    session = engine.store.get("s")
    assert session.cache is None and engine.store.live == 0  # a finished session frees its KV cache
    late = engine.verify(DraftBlock("s", verdict.committed_len, (1, 2)))
    assert (late.status, late.finish_reason, late.committed_len) == (VerdictStatus.FINISHED, STOP, verdict.committed_len)
    done = engine.generate("s", 5)
    assert (done.token_ids, done.finish_reason) == ((), STOP)
    assert engine.release("s") is True and engine.release("s") is False


def test_eos_finishes_unless_ignored(tiny_dir) -> None:
    loaded = load_model(str(tiny_dir), device="cpu", dtype="float32")
    prompt = _prompt(6)
    reference = hf_greedy(loaded.model, prompt, 10)
    loaded.model.generation_config.eos_token_id = reference[0]  # the very first token is now an EOS
    engine = TargetEngine(loaded)
    assert reference[0] in engine.info.eos_token_ids
    first = engine.prefill("eos", prompt, SessionConfig(max_new_tokens=10))
    assert (first.token_id, first.finish_reason, first.committed_len) == (reference[0], STOP, PROMPT_LEN + 1)
    kept = engine.prefill("ignored", prompt, SessionConfig(max_new_tokens=10, ignore_eos=True))
    assert kept.finish_reason == FinishReason.NONE


def test_max_new_tokens_budget(llama) -> None:
    engine = TargetEngine(llama)
    prompt = _prompt(7)
    reference = hf_greedy(llama.model, prompt, 7)
    only = engine.prefill("one", prompt, greedy(1))
    assert only.finish_reason == LENGTH and only.committed_len == PROMPT_LEN + 1
    engine.prefill("s", prompt, greedy(7))
    first = engine.verify(DraftBlock("s", PROMPT_LEN + 1, tuple(reference[1:5])))  # 4 accepted + bonus
    assert first.committed_len == PROMPT_LEN + 6 and first.finish_reason == FinishReason.NONE
    # 1 token of budget left: the block is verified no further than that, the token is a bonus.
    last = engine.verify(DraftBlock("s", PROMPT_LEN + 6, (reference[6], 9, 9, 9)))
    assert (last.num_accepted, list(last.committed_token_ids), last.finish_reason) == (0, [reference[6]], LENGTH)
    assert engine.store.get("s").tokens[PROMPT_LEN:] == reference


def test_generate_cancelled_mid_step_commits_nothing(llama) -> None:
    engine = TargetEngine(llama)
    engine.prefill("s", _prompt(8), greedy())
    session = engine.store.get("s")
    before = (list(session.tokens), session.cache.get_seq_length())
    result = engine.generate("s", 3, cancelled=lambda: True)
    assert result.token_ids == () and (session.tokens, session.cache.get_seq_length()) == before


# --------------------------------------------------------------------------- sessions, metrics, hidden states


def test_ttl_release_and_sessions_active_gauge(llama) -> None:
    now = [0.0]
    metrics = make_metrics("target")
    engine = TargetEngine(llama, session_ttl_s=30.0, metrics=metrics, clock=lambda: now[0])
    gauge = metrics.sessions_active.labels(mode="target")
    engine.prefill("a", _prompt(9), greedy())
    engine.prefill("b", _prompt(10), greedy())
    assert gauge._value.get() == 2
    now[0] = 20.0
    engine.generate("b", 1)
    now[0] = 40.0
    assert engine.expire_idle() == ["a"] and gauge._value.get() == 1
    with pytest.raises(SessionNotFound):
        engine.verify(DraftBlock("a", PROMPT_LEN + 1, (1,)))
    assert engine.release("b") is True and gauge._value.get() == 0
    assert engine.release("b") is False


def test_verify_metrics(llama) -> None:
    metrics = make_metrics("target")
    engine = TargetEngine(llama, metrics=metrics)
    prompt = _prompt(11)
    reference = hf_greedy(llama.model, prompt, NEW_TOKENS)
    engine.prefill("s", prompt, greedy())
    engine.verify(DraftBlock("s", PROMPT_LEN + 1, (*reference[1:3], (reference[3] + 1) % 300, 5)))
    engine.verify(DraftBlock("s", PROMPT_LEN + 1, (1, 2)))  # stale: not a round
    assert metrics.num_drafts._value.get() == 1
    assert (metrics.num_draft_tokens._value.get(), metrics.num_accepted_tokens._value.get()) == (4, 2)
    samples = {s.name: s.value for s in metrics.verify_duration.collect()[0].samples}
    assert samples["tandem_verify_duration_seconds_count"] == 1


def test_hidden_states_of_positions_written_to_the_cache(llama_or_gemma) -> None:
    engine = TargetEngine(llama_or_gemma)
    prompt = _prompt(12)
    reference = hf_greedy(llama_or_gemma.model, prompt, NEW_TOKENS)
    hidden_size = engine.info.hidden_size
    first = engine.prefill("s", prompt, greedy(return_hidden_states=True))
    assert first.hidden_states.shape == (PROMPT_LEN, hidden_size)
    verdict = engine.verify(DraftBlock("s", PROMPT_LEN + 1, (*reference[1:3], (reference[3] + 1) % 300)))
    n = len(verdict.committed_token_ids)
    assert n == 3 and verdict.hidden_states.shape == (n, hidden_size)
    with torch.inference_mode():  # the same states as one fresh pass over the sequence
        out = llama_or_gemma.model(torch.tensor([prompt + reference[:n]]), output_hidden_states=True)
    fresh = out.hidden_states[-1][0]  # [PROMPT_LEN + n, hidden]
    torch.testing.assert_close(first.hidden_states, fresh[:PROMPT_LEN], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(verdict.hidden_states, fresh[PROMPT_LEN:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hidden_states_per_block_and_empty_blocks(llama_or_gemma, temperature) -> None:
    """A block may ask for hidden states when the session was not prefilled asking for them; an
    empty block commits one token (a decode step) and returns the state that produced it."""
    engine = TargetEngine(llama_or_gemma)
    prompt = _prompt(15)
    config = greedy(temperature=temperature, seed=3)
    engine.prefill("s", prompt, config)
    plain = engine.verify(DraftBlock("s", PROMPT_LEN + 1, ()))
    assert plain.status == VerdictStatus.OK and len(plain.committed_token_ids) == 1 and plain.hidden_states is None
    asked = engine.verify(DraftBlock("s", PROMPT_LEN + 2, (), block_id=1, return_hidden_states=True))
    assert asked.status == VerdictStatus.OK and asked.num_accepted == 0 and len(asked.committed_token_ids) == 1
    assert asked.hidden_states.shape == (1, engine.info.hidden_size)
    drafts = (5, 6)
    block = engine.verify(DraftBlock("s", PROMPT_LEN + 3, drafts, block_id=2, return_hidden_states=True))
    n = len(block.committed_token_ids)
    assert block.hidden_states.shape == (n, engine.info.hidden_size)
    tokens = engine.store.get("s").tokens
    assert len(tokens) == PROMPT_LEN + 3 + n
    with torch.inference_mode():  # row i: the position whose logits produced committed token i
        fresh = llama_or_gemma.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(asked.hidden_states, fresh[PROMPT_LEN + 1 : PROMPT_LEN + 2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(block.hidden_states, fresh[PROMPT_LEN + 2 : PROMPT_LEN + 2 + n], atol=1e-4, rtol=1e-4)
    if temperature == 0.0:
        assert list(tokens[PROMPT_LEN:]) == hf_greedy(llama_or_gemma.model, prompt, len(tokens) - PROMPT_LEN)


def test_sampling_is_reproducible_per_seed(llama) -> None:
    engine = TargetEngine(llama)
    prompt = _prompt(13)

    def run(session_id: str, seed: int) -> list[int]:
        config = SessionConfig(max_new_tokens=12, temperature=1.0, top_k=20, seed=seed, ignore_eos=True)
        engine.prefill(session_id, prompt, config)
        q = SparseDist((7, 9), (0.5, 0.5))
        engine.verify(DraftBlock(session_id, PROMPT_LEN + 1, (7, 9), draft_probs=(q, q)))
        engine.generate(session_id, 100)
        return engine.store.get(session_id).tokens[PROMPT_LEN:]

    assert run("a", 5) == run("b", 5)
    assert run("c", 5) != run("d", 6)


def test_refusals(llama) -> None:
    engine = TargetEngine(llama)
    with pytest.raises(TokenizerMismatch) as mismatch:
        engine.prefill("s", [5, 6], greedy(), tokenizer_fingerprint="f" * 32)
    message = str(mismatch.value)
    assert engine.info.model_name in message and engine.info.tokenizer_fingerprint in message and "f" * 32 in message
    engine.prefill("s", [5, 6], greedy(), tokenizer_fingerprint=engine.info.tokenizer_fingerprint)
    with pytest.raises(InvalidArgument, match="probability 0"):
        engine.verify(DraftBlock("s", 3, (4,), draft_probs=(SparseDist((5,), (1.0,)),)))
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        engine.prefill("t", [5, 300], greedy())


def test_a_failed_forward_pass_drops_only_that_session(llama, monkeypatch) -> None:
    engine = TargetEngine(llama)
    prompt = _prompt(14)
    engine.prefill("broken", prompt, greedy())
    engine.prefill("fine", prompt, greedy())

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "model", out_of_memory)
        with pytest.raises(RuntimeError):
            engine.verify(DraftBlock("broken", PROMPT_LEN + 1, (1, 2)))
    with pytest.raises(SessionNotFound):  # its cache may be half-written: it is gone
        engine.generate("broken", 1)
    assert engine.generate("fine", 3).committed_len == PROMPT_LEN + 4
    assert engine.store.live == 1
