"""vLLM's min_tokens in the target: the rows that score a session's first min_tokens tokens have its
stop tokens masked (against the formula over the model's own logits), so speculation keeps the
answer, greedy token for token and sampled in distribution; on tiny float and quantized targets
(whose greedy head takes over once the floor is passed) and over gRPC's conversion."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.models import load_model
from tandem.rpc import codecs
from tandem.rpc.types import Grammar, GrammarKind, SamplingParams, SessionParams
from target_service import min_tokens, wire
from target_service.engine import TargetEngine
from target_service.errors import InvalidArgument
from target_service.session import SessionConfig
from target_service.types import DraftBlock
from engine_sessions import decode_step, run_together
from test_quant_model import quantized_gemma  # noqa: F401 (a fixture)
from test_target_engine import _prompt as prompt_ids
from test_target_grammar import decode, speculate  # random chains and trees around a guide
from test_target_logit_bias import assert_pairs_follow, exact_pairs

FLOOR = 5


@pytest.fixture(scope="module", params=["llama", "gemma"])
def loaded(request, tiny_dir, tiny_gemma_dir):
    return load_model(str(tiny_dir if request.param == "llama" else tiny_gemma_dir), device="cpu", dtype="float32")


@torch.inference_mode()
def step_logits(model, tokens: list[int], bias: dict[int, float], banned: set[int]) -> torch.Tensor:
    logits = model(torch.tensor([tokens])).logits[0, -1].float()  # [vocab]
    for token, value in bias.items():
        logits[token] += value
    logits[sorted(banned)] = float("-inf")
    return logits


def floored_greedy(model, prompt: list[int], n: int, bias: dict[int, float], stops: set[int]) -> list[int]:
    """Greedy decoding by the formula: the stop tokens banned for the first FLOOR steps, then ending it."""
    out: list[int] = []
    while len(out) < n:
        out.append(int(step_logits(model, prompt + out, bias, stops if len(out) < FLOOR else set()).argmax()))
        if out[-1] in stops:
            break
    return out


def test_greedy_answer_is_the_formula_and_speculation_keeps_it(loaded) -> None:
    """EOS lifted above every other token: without the floor it is the first token, with it the
    sixth; drafts that propose EOS at every position are rejected until then."""
    engine = TargetEngine(loaded)
    eos = engine.info.eos_token_ids[0]
    prompt = prompt_ids(90)
    bias = {eos: 100.0}
    lifted = SessionConfig(max_new_tokens=16, logit_bias=((eos, 100.0),))
    assert decode(engine, prompt, lifted, "plain") == [eos]
    config = SessionConfig(max_new_tokens=16, logit_bias=((eos, 100.0),), min_tokens=FLOOR)
    tokens = decode(engine, prompt, config, "ar")
    assert tokens == floored_greedy(loaded.model, prompt, 16, bias, set(engine.info.eos_token_ids))
    assert len(tokens) == FLOOR + 1 and tokens[-1] == eos and eos not in tokens[:-1]
    for seed in range(3):
        assert speculate(engine, prompt, config, f"se{seed}", random.Random(seed), [eos] * 16) == tokens
        assert speculate(engine, prompt, config, f"st{seed}", random.Random(seed), tokens) == tokens


def test_stop_token_ids_are_held_back_too_and_the_greedy_head_takes_over(quantized_gemma) -> None:
    """A stop token id the plain answer holds early is not taken before the floor; past it the
    session leaves the logits path for the quantized target's greedy head, and keeps its answer."""
    engine = TargetEngine(quantized_gemma)
    prompt = prompt_ids(91)
    plain = decode(engine, prompt, SessionConfig(max_new_tokens=24, ignore_eos=True), "plain")
    stop = plain[0]
    config = SessionConfig(max_new_tokens=24, ignore_eos=True, stop_token_ids=(stop,), min_tokens=3)
    tokens = decode(engine, prompt, config, "ar")
    assert stop not in tokens[:3] and tokens[0] != plain[0]
    for seed in range(2):
        assert speculate(engine, prompt, config, f"sp{seed}", random.Random(seed), plain) == tokens
    # With nothing to hold back (EOS ignored, no stop ids) a floor leaves the greedy head on.
    engine.prefill("free", prompt, SessionConfig(max_new_tokens=8, ignore_eos=True, min_tokens=8))
    held = SessionConfig(max_new_tokens=8, ignore_eos=True, stop_token_ids=(stop,), min_tokens=8)
    engine.prefill("held", prompt, held)
    assert engine.runner.screens(engine.store.get("free")) and not engine.runner.screens(engine.store.get("held"))


def test_sampled_tokens_follow_the_floored_distribution_speculative_or_not(tiny_dir) -> None:
    """The first two sampled tokens with a floor of two, decoded or verified from random drafts
    (EOS among them), against softmax(logits + bias) with EOS masked, computed here (on one tiny
    model: the mask does not depend on the architecture)."""
    loaded = load_model(str(tiny_dir), device="cpu", dtype="float32")
    engine = TargetEngine(loaded)
    eos = engine.info.eos_token_ids[0]
    stops = set(engine.info.eos_token_ids)
    prompt = prompt_ids(92)
    bias = {eos: 9.0, 5: 8.5, 6: 8.0, 7: 7.0}
    favoured = [5, 6, 7]
    exact = exact_pairs(lambda tokens: step_logits(loaded.model, tokens, bias, stops), prompt, favoured)
    rng = random.Random(0)
    n = 400
    configs = [SessionConfig(max_new_tokens=3, temperature=1.0, seed=seed, min_tokens=2,
                             logit_bias=tuple(sorted(bias.items()))) for seed in range(n)]

    def one_block(session_id: str, tokens: list[int], block_id: int) -> DraftBlock:
        """A random block after the first token (EOS among its drafts); the session then decodes."""
        if block_id > 1:
            return decode_step(session_id, tokens, block_id)
        drafts = tuple(rng.choice([eos, *favoured]) for _ in range(rng.randint(1, 3)))
        return DraftBlock(session_id, len(prompt) + len(tokens), drafts, block_id=block_id)

    for how in ("decode", "speculate"):
        counts = dict.fromkeys(exact, 0)
        for tokens in run_together(engine, prompt, configs, decode_step if how == "decode" else one_block):
            assert eos not in tokens[:2], tokens
            key = tuple(tokens[:2])
            if key in counts:
                counts[key] += 1
        assert_pairs_follow(counts, exact, n, how)


def test_rows_are_numbered_by_their_depth_in_chains_and_trees() -> None:
    assert min_tokens.row_numbers(4, 4) == [4, 5, 6, 7]
    # drafts 0 and 1 under the root, 2 under 0, 3 under 2: rows 1-4 score tokens 5, 5, 6, 7
    assert min_tokens.row_numbers(4, 5, [min_tokens.ROOT, min_tokens.ROOT, 0, 2]) == [4, 5, 5, 6, 7]
    logits = torch.zeros(5, 8)  # [rows, vocab]
    out = min_tokens.masked(logits, 4, 6, {2, 7}, [min_tokens.ROOT, min_tokens.ROOT, 0, 2])
    assert out[:3, [2, 7]].eq(float("-inf")).all() and out[3:].isfinite().all() and out[:, :2].eq(0).all()
    assert logits.eq(0).all()


def test_a_floor_is_refused_past_the_budget_or_with_a_grammar_and_crosses_the_wire(loaded) -> None:
    engine = TargetEngine(loaded)
    with pytest.raises(InvalidArgument, match="min_tokens must be in"):
        engine.prefill("x", prompt_ids(1), SessionConfig(max_new_tokens=4, min_tokens=5))
    grammar = Grammar(GrammarKind.REGEX, "a+")
    with pytest.raises(InvalidArgument, match="min_tokens cannot be combined with a grammar"):
        engine.prefill("x", prompt_ids(1), SessionConfig(max_new_tokens=4, min_tokens=2, grammar=grammar))
    params = SessionParams(SamplingParams(), 8, min_tokens=3)
    assert codecs.session_params(codecs.session_params_to_wire(params)) == params
    assert wire.session_config(codecs.session_params_to_wire(params), False).min_tokens == 3
