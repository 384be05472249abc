"""allowed_token_ids in the target (target_service.allowed_tokens): greedy decoding is the argmax over
the allowed ids of the model's own logits, decoded and through random chains and trees; sampled
tokens follow softmax over them; refusals by name; the field over the wire."""

from __future__ import annotations

import random

import pytest
import torch
from scipy import stats

from engine_sessions import decode_step, run_together
from tandem.models import load_model
from tandem.rpc import codecs
from tandem.rpc.types import Grammar, GrammarKind, SamplingParams, SessionParams
from target_service import wire
from target_service.engine import TargetEngine
from target_service.errors import InvalidArgument
from target_service.session import SessionConfig
from target_service.types import DraftBlock
from test_target_engine import _prompt as prompt_ids
from test_target_grammar import decode, speculate  # random chains and trees around a guide
from test_target_logit_bias import exact_pairs

NEW = 16


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return load_model(str(tiny_dir), device="cpu", dtype="float32")


@torch.inference_mode()
def allowed_logits(model, tokens: list[int], allowed: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([tokens])).logits[0, -1].float()  # [vocab]
    out = torch.full_like(logits, float("-inf"))
    out[allowed] = logits[allowed]
    return out


def test_greedy_decoding_takes_the_best_allowed_token_and_speculation_keeps_it(loaded) -> None:
    engine = TargetEngine(loaded)
    prompt = prompt_ids(60)
    plain = decode(engine, prompt, SessionConfig(max_new_tokens=NEW, ignore_eos=True), "plain")
    allowed = sorted({*plain[1::2], 7, 11, 250})  # half the plain answer's tokens, and a few others
    wanted = []
    for _ in range(NEW):
        wanted.append(int(allowed_logits(loaded.model, prompt + wanted, allowed).argmax()))
    assert set(wanted) <= set(allowed) and wanted != plain
    config = SessionConfig(max_new_tokens=NEW, ignore_eos=True, allowed_token_ids=tuple(allowed))
    assert decode(engine, prompt, config, "decoded") == wanted
    for seed in range(4):  # drafts that follow the plain answer propose tokens that are not allowed
        guide = (plain, wanted)[seed % 2]
        assert speculate(engine, prompt, config, f"sp{seed}", random.Random(seed), guide)[:NEW] == wanted


def test_sampled_tokens_follow_the_distribution_over_the_allowed_ids(loaded) -> None:
    """The first two sampled tokens, decoded or verified from random drafts (mostly of ids that are
    not allowed), against softmax over the four allowed ids computed here."""
    engine = TargetEngine(loaded)
    prompt = prompt_ids(61)
    allowed = [5, 6, 7, 8]
    exact = exact_pairs(lambda tokens: allowed_logits(loaded.model, tokens, allowed), prompt, allowed)
    assert abs(sum(exact.values()) - 1) < 1e-5
    rng = random.Random(0)
    n = 400
    configs = [SessionConfig(max_new_tokens=2, temperature=1.0, seed=seed, ignore_eos=True,
                             allowed_token_ids=tuple(allowed)) for seed in range(n)]

    def one_block(session_id: str, tokens: list[int], block_id: int) -> DraftBlock:
        drafts = tuple(rng.choice(allowed + [rng.randrange(engine.vocab_size)] * 4) for _ in range(rng.randint(1, 3)))
        return DraftBlock(session_id, len(prompt) + len(tokens), drafts, block_id=block_id)

    for how in ("decode", "speculate"):
        counts = dict.fromkeys(exact, 0)
        for tokens in run_together(engine, prompt, configs, decode_step if how == "decode" else one_block):
            assert tokens[0] in allowed and tokens[1] in allowed, tokens
            counts[tuple(tokens[:2])] += 1
        total = sum(exact.values())  # 1 up to float32 rounding: the allowed pairs hold all the mass
        assert stats.chisquare(list(counts.values()), [p / total * n for p in exact.values()]).pvalue > 1e-4, (
            how, counts, exact)


def test_allowed_token_ids_are_refused_by_name_and_cross_the_wire(loaded) -> None:
    engine = TargetEngine(loaded)
    cases = {
        "outside the vocabulary": SessionConfig(max_new_tokens=4, allowed_token_ids=(5, engine.vocab_size)),
        "with a grammar": SessionConfig(max_new_tokens=4, allowed_token_ids=(5,),
                                        grammar=Grammar(GrammarKind.REGEX, "a+")),
        "with bad_words": SessionConfig(max_new_tokens=4, allowed_token_ids=(5,), bad_words=((5,),)),
        "with min_tokens": SessionConfig(max_new_tokens=4, allowed_token_ids=(5,), min_tokens=2),
    }
    for message, config in cases.items():
        with pytest.raises(InvalidArgument, match=message.replace("with ", "")):
            engine.prefill("x", prompt_ids(1), config)
    params = SessionParams(SamplingParams(), 4, allowed_token_ids=(5, 9))
    assert codecs.session_params(codecs.session_params_to_wire(params)) == params
    assert wire.session_config(codecs.session_params_to_wire(params), False).allowed_token_ids == (5, 9)
    assert SessionConfig(max_new_tokens=4, allowed_token_ids=(5,)).reshapes_logits
