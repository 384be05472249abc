"""OpenAI's logit_bias in the target: each row a session scores has the bias added (against the
formula over the model's own logits), so speculation keeps the biased answer, greedy token for token
and sampled in distribution; on tiny float and quantized targets and over gRPC's conversion."""

from __future__ import annotations

import random

import pytest
import torch
from scipy import stats

from tandem.models import load_model
from tandem.rpc import codecs
from tandem.rpc.types import SamplingParams, SessionParams
from target_service import wire
from target_service.engine import TargetEngine
from target_service.errors import InvalidArgument
from target_service.logit_bias import LogitBias
from target_service.session import SessionConfig
from target_service.types import DraftBlock
from engine_sessions import decode_step, run_together
from test_quant_model import quantized_gemma  # noqa: F401 (a fixture)
from test_target_engine import _prompt as prompt_ids
from test_target_grammar import decode, speculate  # random chains and trees around a guide

NEW = 24


@pytest.fixture(scope="module", params=["llama", "gemma"])
def loaded(request, tiny_dir, tiny_gemma_dir):
    return load_model(str(tiny_dir if request.param == "llama" else tiny_gemma_dir), device="cpu", dtype="float32")


@torch.inference_mode()
def biased_logits(model, tokens: list[int], bias: dict[int, float]) -> torch.Tensor:
    logits = model(torch.tensor([tokens])).logits[0, -1].float()  # [vocab]
    for token, value in bias.items():
        logits[token] += value
    return logits


def biased_greedy(model, prompt: list[int], n: int, bias: dict[int, float]) -> list[int]:
    """Greedy decoding with the bias added as OpenAI documents it, one whole forward per step."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(biased_logits(model, prompt + out, bias).argmax()))
    return out


def test_biased_greedy_decoding_is_the_formulas_and_speculation_keeps_it(loaded) -> None:
    engine = TargetEngine(loaded)
    prompt = prompt_ids(80)
    plain = decode(engine, prompt, SessionConfig(max_new_tokens=NEW, ignore_eos=True), "plain")
    # Ban the plain answer's first tokens, lift a few others a little.
    bias = {**{t: -100.0 for t in plain[:3]}, **{t: 3.0 for t in range(10, 14)}}
    config = SessionConfig(max_new_tokens=NEW, ignore_eos=True, logit_bias=tuple(sorted(bias.items())))
    tokens = decode(engine, prompt, config, "ar")
    assert tokens == biased_greedy(loaded.model, prompt, NEW, bias)
    assert tokens != plain and not set(tokens) & set(plain[:3])
    for seed in range(3):  # drafts that follow the plain answer propose the banned tokens
        assert speculate(engine, prompt, config, f"sp{seed}", random.Random(seed), plain)[:NEW] == tokens
        assert speculate(engine, prompt, config, f"sq{seed}", random.Random(seed), tokens)[:NEW] == tokens


def test_the_quantized_target_keeps_its_biased_answer_speculating(quantized_gemma) -> None:
    engine = TargetEngine(quantized_gemma)
    prompt = prompt_ids(81)
    plain = decode(engine, prompt, SessionConfig(max_new_tokens=NEW, ignore_eos=True), "plain")
    config = SessionConfig(max_new_tokens=NEW, ignore_eos=True, logit_bias=((plain[1], -100.0), (plain[4], -50.0)))
    tokens = decode(engine, prompt, config, "ar")
    assert tokens != plain
    for seed in range(2):
        assert speculate(engine, prompt, config, f"sp{seed}", random.Random(seed), plain)[:NEW] == tokens


def test_sampled_tokens_follow_the_biased_distribution_speculative_or_not(loaded) -> None:
    """The first two sampled tokens, decoded or verified from random drafts, against the exact
    distribution of softmax(logits + bias) computed here; the bias gathers the mass on four tokens
    so that the cells are few."""
    engine = TargetEngine(loaded)
    prompt = prompt_ids(82)
    bias = {5: 9.0, 6: 8.5, 7: 8.0, 8: 7.0}
    favoured = sorted(bias)
    exact = exact_pairs(lambda tokens: biased_logits(loaded.model, tokens, bias), prompt, favoured)
    rng = random.Random(0)
    n = 400
    configs = [SessionConfig(max_new_tokens=2, temperature=1.0, seed=seed, ignore_eos=True,
                             logit_bias=tuple(sorted(bias.items()))) for seed in range(n)]

    def one_block(session_id: str, tokens: list[int], block_id: int) -> DraftBlock:
        drafts = tuple(rng.choice(favoured + [rng.randrange(engine.vocab_size)]) for _ in range(rng.randint(1, 3)))
        return DraftBlock(session_id, len(prompt) + len(tokens), drafts, block_id=block_id)

    for how in ("decode", "speculate"):
        counts = dict.fromkeys(exact, 0)
        for tokens in run_together(engine, prompt, configs, decode_step if how == "decode" else one_block):
            key = tuple(tokens[:2])
            if key in counts:
                counts[key] += 1
        assert_pairs_follow(counts, exact, n, how)


def exact_pairs(logits_after, prompt: list[int], favoured: list[int]) -> dict[tuple[int, int], float]:
    """The exact probability of each pair of ``favoured`` tokens as a session's first two, from
    ``logits_after(tokens)`` [vocab], the logits the next token is sampled from."""
    first = torch.softmax(logits_after(prompt), dim=-1)  # [vocab]
    exact = {}
    for a in favoured:
        second = torch.softmax(logits_after(prompt + [a]), dim=-1)  # [vocab]
        for b in favoured:
            exact[a, b] = float(first[a] * second[b])
    return exact


def assert_pairs_follow(counts: dict, exact: dict, n: int, how: str) -> None:
    """Chi-square of ``n`` sessions' first two tokens: ``counts`` of the pairs in ``exact`` (their
    exact probabilities, most of the mass), every other pair pooled into one more cell."""
    observed = list(counts.values()) + [n - sum(counts.values())]
    expected = [p * n for p in exact.values()] + [n * (1 - sum(exact.values()))]
    if expected[-1] < 5:  # chi-square's rule: the rest pooled into the last cell
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    assert sum(exact.values()) > 0.5  # the cells hold most of the mass
    assert stats.chisquare(observed, expected).pvalue > 1e-4, (how, counts, exact)


def test_log_probabilities_stay_the_models_own(loaded) -> None:
    engine = TargetEngine(loaded)
    prompt = prompt_ids(83)
    config = SessionConfig(max_new_tokens=4, top_logprobs=2, logit_bias=((9, 100.0),))
    first = engine.prefill("lp", prompt, config)
    assert first.token_id == 9
    logp = torch.log_softmax(biased_logits(loaded.model, prompt, {}), dim=-1)  # [vocab]
    assert first.logprobs.logprob == pytest.approx(float(logp[9]), abs=1e-4)
    assert first.logprobs.top_logprobs[0] == pytest.approx(float(logp.max()), abs=1e-4)
    engine.release("lp")


def test_bias_is_added_to_every_row_and_leaves_the_logits_it_was_given() -> None:
    logits = torch.zeros(3, 8)  # [rows, vocab]
    out = LogitBias(((2, -100.0), (5, 1.5)), "cpu").applied(logits)
    assert out[:, 2].eq(-100).all() and out[:, 5].eq(1.5).all() and out.sum() == 3 * (-100 + 1.5)
    assert logits.eq(0).all()


def test_a_bias_is_refused_outside_its_range_or_the_vocabulary_and_crosses_the_wire(loaded) -> None:
    engine = TargetEngine(loaded)
    for bias, message in ((((3, 100.5),), "must be in"), (((3, float("nan")),), "must be in"),
                          (((engine.vocab_size, 1.0),), "outside the vocabulary"), (((-1, 1.0),), "outside")):
        with pytest.raises(InvalidArgument, match="logit_bias: .*" + message):
            engine.prefill("x", prompt_ids(1), SessionConfig(max_new_tokens=4, logit_bias=bias))
    params = SessionParams(SamplingParams(), 4, logit_bias=((3, -1.5), (70, 100.0)))
    assert codecs.session_params(codecs.session_params_to_wire(params)) == params
    assert wire.session_config(codecs.session_params_to_wire(params), False).logit_bias == ((3, -1.5), (70, 100.0))
