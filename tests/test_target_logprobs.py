"""The target's log-probabilities of committed tokens: the model's own log-softmax at each token's
position, the same from a prompt's last row, a decode step, a verified chain or a token tree, greedy
or sampled; on tiny random Llama and Gemma 3 targets and over gRPC's conversion."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.models import load_model
from tandem.rpc import codecs
from tandem.rpc.types import TokenLogprob
from target_service import wire
from target_service.engine import TargetEngine
from target_service.errors import InvalidArgument
from target_service.session import SessionConfig
from target_service.types import DraftBlock, VerdictStatus
from test_target_engine import hf_greedy
from test_target_engine import _prompt as prompt_ids
from test_quant_model import quantized_gemma  # noqa: F401 (a fixture)
from test_target_tree import random_tree

NEW = 16
TOP = 3


@pytest.fixture(scope="module", params=["llama", "gemma"])
def loaded(request, tiny_dir, tiny_gemma_dir):
    return load_model(str(tiny_dir if request.param == "llama" else tiny_gemma_dir), device="cpu", dtype="float32")


@torch.inference_mode()
def reference(model, tokens: list[int], prompt_len: int, top: int) -> list[TokenLogprob]:
    """transformers' log-softmax at each generated token's position, in one forward of the whole sequence."""
    logits = model(torch.tensor([tokens])).logits[0].float()  # [len, vocab]
    logp = torch.log_softmax(logits, dim=-1)[prompt_len - 1 : len(tokens) - 1]  # [generated, vocab]
    values, ids = logp.topk(top, dim=-1)
    return [
        TokenLogprob(float(row[token]), tuple(i.tolist()), tuple(v.tolist()))
        for row, token, i, v in zip(logp, tokens[prompt_len:], ids, values)
    ]


def assert_close(got: list[TokenLogprob], want: list[TokenLogprob]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=1e-4)
        # The same alternatives, but for near-ties the float summation order of the pass may swap.
        assert set(g.top_token_ids) == set(w.top_token_ids) or g.top_logprobs[-1] == pytest.approx(
            g.top_logprobs[-2], abs=1e-4
        )


def run_autoregressive(engine: TargetEngine, prompt: list[int], config: SessionConfig) -> tuple[list[int], list]:
    first = engine.prefill("ar", prompt, config)
    tokens, logprobs = [first.token_id], [first.logprobs]
    while len(tokens) < config.max_new_tokens:
        result = engine.generate("ar", 1)
        tokens += result.token_ids
        logprobs += result.logprobs
    return tokens, logprobs


def run_speculative(
    engine: TargetEngine, prompt: list[int], config: SessionConfig, seed: int
) -> tuple[list[int], list]:
    """Random chains and trees (some of each drafted from the target's own greedy continuation)."""
    first = engine.prefill("sp", prompt, config)
    tokens, logprobs = [first.token_id], [first.logprobs]
    rng = random.Random(seed)
    greedy_continuation = hf_greedy(engine.runner.model, prompt, config.max_new_tokens + 8)
    block_id = 0
    while len(tokens) < config.max_new_tokens:
        block_id += 1
        ahead = greedy_continuation[len(tokens) :]
        if rng.random() < 0.5:
            drafts, parents = random_tree(rng, ahead, rng.randint(1, 6))
        else:
            drafts, parents = [t if rng.random() < 0.7 else rng.randrange(300) for t in ahead[: rng.randint(0, 4)]], []
        verdict = engine.verify(
            DraftBlock("sp", len(prompt) + len(tokens), tuple(drafts), block_id=block_id, draft_parents=tuple(parents))
        )
        assert verdict.status is VerdictStatus.OK
        assert len(verdict.logprobs) == len(verdict.committed_token_ids)
        tokens += verdict.committed_token_ids
        logprobs += verdict.logprobs
    return tokens, logprobs


def test_each_token_carries_the_models_own_log_softmax_and_its_top_alternatives(loaded) -> None:
    engine = TargetEngine(loaded)
    prompt = prompt_ids(5)
    config = SessionConfig(max_new_tokens=NEW, ignore_eos=True, top_logprobs=TOP)
    tokens, logprobs = run_autoregressive(engine, prompt, config)
    assert tokens == hf_greedy(loaded.model, prompt, NEW)
    assert_close(logprobs, reference(loaded.model, prompt + tokens, len(prompt), TOP))
    for lp in logprobs:  # greedy: the chosen token is the most probable one
        assert lp.logprob == pytest.approx(lp.top_logprobs[0], abs=1e-6)
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)


def assert_speculation_reports_what_decoding_does(engine: TargetEngine, prompt: list[int], seed: int) -> None:
    config = SessionConfig(max_new_tokens=NEW, ignore_eos=True, top_logprobs=TOP)
    ar_tokens, ar_logprobs = run_autoregressive(engine, prompt, config)
    sp_tokens, sp_logprobs = run_speculative(engine, prompt, config, seed=seed)
    assert sp_tokens[:NEW] == ar_tokens
    assert_close(sp_logprobs[:NEW], ar_logprobs)


def test_speculative_and_autoregressive_sessions_report_the_same_values(loaded) -> None:
    assert_speculation_reports_what_decoding_does(TargetEngine(loaded), prompt_ids(6), seed=1)


def test_sampled_tokens_get_the_distribution_before_temperature(loaded) -> None:
    engine = TargetEngine(loaded)
    prompt = prompt_ids(7)
    config = SessionConfig(max_new_tokens=NEW, ignore_eos=True, temperature=1.7, top_k=5, seed=3, top_logprobs=0)
    tokens, logprobs = run_speculative(engine, prompt, config, seed=2)
    want = reference(loaded.model, prompt + tokens, len(prompt), 1)
    for got, w in zip(logprobs, want):
        assert got.top_token_ids == () and got.logprob == pytest.approx(w.logprob, abs=1e-4)


def test_sessions_without_them_get_none_and_greedy_tokens_do_not_change(loaded) -> None:
    engine = TargetEngine(loaded)
    prompt = prompt_ids(8)
    plain = engine.prefill("plain", prompt, SessionConfig(max_new_tokens=NEW, ignore_eos=True))
    assert plain.logprobs is None
    result = engine.generate("plain", NEW - 1)
    assert result.logprobs == ()
    asked = engine.prefill("asked", prompt, SessionConfig(max_new_tokens=NEW, ignore_eos=True, top_logprobs=1))
    other = engine.generate("asked", NEW - 1)
    assert (asked.token_id, *other.token_ids) == (plain.token_id, *result.token_ids)
    assert len(other.logprobs) == NEW - 1


def test_out_of_range_top_logprobs_is_refused(loaded) -> None:
    engine = TargetEngine(loaded)
    for bad in (-1, 21):
        with pytest.raises(InvalidArgument, match="top_logprobs must be in"):
            engine.prefill("bad", prompt_ids(1), SessionConfig(max_new_tokens=4, top_logprobs=bad))
    assert engine.store.live == 0


def test_logprobs_cross_the_wire(loaded) -> None:
    engine = TargetEngine(loaded)
    prompt = prompt_ids(9)
    first = engine.prefill("w", prompt, SessionConfig(max_new_tokens=NEW, ignore_eos=True, top_logprobs=2))
    message = wire.prefill_response(first)
    assert message.HasField("logprobs") and message.logprobs.logprob == pytest.approx(first.logprobs.logprob)
    assert list(message.logprobs.top_token_ids) == list(first.logprobs.top_token_ids)
    verdict = engine.verify(DraftBlock("w", len(prompt) + 1, (1, 2, 3)))
    back = codecs.verdict(wire.verify_response(verdict))
    assert [lp.top_token_ids for lp in back.logprobs] == [lp.top_token_ids for lp in verdict.logprobs]
    assert [lp.logprob for lp in back.logprobs] == pytest.approx([lp.logprob for lp in verdict.logprobs])
    step = engine.generate("w", 1)
    assert len(wire.generate_response(step).logprobs) == 1
    plain = engine.prefill("p", prompt, SessionConfig(max_new_tokens=NEW))
    assert not wire.prefill_response(plain).HasField("logprobs")


def test_the_quantized_target_reports_the_same_values_speculating_or_not(quantized_gemma) -> None:
    """The served model's own: a target computing on a GGUF file's blocks (every kernel this host
    runs), where a verified block's rows are scored as one-token steps would be."""
    assert_speculation_reports_what_decoding_does(TargetEngine(quantized_gemma), prompt_ids(10), seed=4)


@pytest.mark.parametrize("chunk", [0, 7])
def test_a_prompts_own_tokens_get_theirs_whatever_its_chunks(loaded, chunk) -> None:
    """echo with logprobs: every prompt token after the first, scored by the row before it, in
    passes of ``chunk`` rows (0: the whole prompt; the engine caps a chunk at 64 rows); the prefix
    cache is not used for it (its rows were never scored)."""
    engine = TargetEngine(loaded, prefill_chunk_tokens=chunk)
    prompt = prompt_ids(11)
    engine.prefill("first", prompt + [5], SessionConfig(max_new_tokens=4, ignore_eos=True))
    engine.generate("first", 3)
    engine.release("first")  # its cache is kept: the prompt below starts the same way
    config = SessionConfig(max_new_tokens=1, ignore_eos=True, top_logprobs=2)
    result = engine.prefill("s", prompt, config, prompt_logprobs=True)
    assert result.cached_tokens == 0 and len(result.prompt_logprobs) == len(prompt) - 1
    assert_close(list(result.prompt_logprobs), reference(loaded.model, prompt, 1, 2)[: len(prompt) - 1])
    alone = TargetEngine(loaded).prefill("t", prompt, config)  # the first token is the same either way
    assert result.token_id == alone.token_id
    assert_close([result.logprobs], [alone.logprobs])


def test_prompt_logprobs_on_the_quantized_target(quantized_gemma) -> None:
    """A generated continuation, sent back as a prompt: its tokens' prompt log-probabilities are the
    ones decoding reported (to the bit where the runner is row-exact), in chunks of any size."""
    prompt = prompt_ids(12)
    decoded = TargetEngine(quantized_gemma)
    tokens, logprobs = run_autoregressive(decoded, prompt, SessionConfig(max_new_tokens=8, ignore_eos=True,
                                                                         top_logprobs=1))
    for chunk in (3, 0):
        engine = TargetEngine(quantized_gemma, prefill_chunk_tokens=chunk)
        scored = engine.prefill("s", prompt + tokens, SessionConfig(max_new_tokens=1, top_logprobs=1),
                                prompt_logprobs=True).prompt_logprobs
        assert_close(list(scored[len(prompt) - 1 :]), logprobs)
        if engine.runner.row_exact:  # int8 activations: each row computed as a one-token step would be
            assert list(scored[len(prompt) - 1 :]) == logprobs
