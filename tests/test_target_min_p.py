"""min_p in the target (target_service.min_p): the cut against its definition over probabilities,
greedy sessions untouched (they keep the greedy head), bad values refused, the field over the wire
(typical_p's too).
Speculation keeping the cut distribution is tested with the other samplers (test_target_sampling)."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.models import load_model
from tandem.rpc import codecs
from tandem.rpc.types import SamplingParams, SessionParams
from target_service import min_p, wire
from target_service.engine import TargetEngine
from target_service.errors import InvalidArgument
from target_service.session import SessionConfig
from test_target_engine import _prompt as prompt_ids
from test_target_grammar import decode, speculate


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.9])
@pytest.mark.parametrize("cut", [0.01, 0.2, 1.0])
def test_the_cut_keeps_exactly_the_tokens_within_min_p_of_the_best(temperature: float, cut: float) -> None:
    generator = torch.Generator().manual_seed(int(temperature * 10 + cut * 100))
    logits = torch.randn(6, 500, generator=generator) * 4  # [rows, vocab]
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie at the top: both stay
    logits[4, :400] = float("-inf")  # already masked (a grammar's): stays masked, the rest is cut as usual
    given = logits.clone()
    out = min_p.masked(logits, temperature, cut)
    probs = torch.softmax(logits.double() / temperature, dim=-1)  # [rows, vocab]
    ratio = probs / probs.amax(dim=-1, keepdim=True)  # [rows, vocab]
    clear = (ratio - cut).abs() > 1e-5  # away from the edge, where float32 and float64 could round apart
    assert torch.equal(out.isfinite()[clear], (ratio >= cut)[clear])
    assert torch.equal(out[out.isfinite()], logits[out.isfinite()])  # kept logits unchanged
    assert out[2, 7].isfinite() and out[2, 9].isfinite() and out[4, :400].isneginf().all()
    assert torch.equal(logits, given)  # a copy: the scores it was given are left alone
    if cut == 1.0:
        assert out.isfinite().sum(dim=-1).tolist() == [1, 1, 2, 1, 1, 1]


def test_only_sampled_sessions_are_cut() -> None:
    assert not SessionConfig(max_new_tokens=4, min_p=0.5).reshapes_logits  # greedy: the argmax always stays
    assert SessionConfig(max_new_tokens=4, temperature=0.7, min_p=0.5).reshapes_logits
    assert not SessionConfig(max_new_tokens=4, temperature=0.7).reshapes_logits


def test_greedy_answers_ignore_min_p_and_sampled_ones_never_take_a_cut_token(tiny_dir) -> None:
    engine = TargetEngine(load_model(str(tiny_dir), device="cpu", dtype="float32"))
    prompt = prompt_ids(90)
    plain = decode(engine, prompt, SessionConfig(max_new_tokens=12, ignore_eos=True), "plain")
    cut = SessionConfig(max_new_tokens=12, ignore_eos=True, min_p=0.9)
    assert decode(engine, prompt, cut, "greedy") == plain
    # min_p 1 at a low temperature keeps each row's argmax alone: sampling is then the greedy answer,
    # decoded or verified from drafts that follow other tokens.
    alone = SessionConfig(max_new_tokens=12, ignore_eos=True, temperature=0.5, min_p=1.0, seed=3)
    assert decode(engine, prompt, alone, "alone") == plain
    for seed in range(2):
        guide = (plain, plain[::-1])[seed]
        assert speculate(engine, prompt, alone, f"sp{seed}", random.Random(seed), guide)[:12] == plain


@pytest.mark.parametrize("name", ["min_p", "typical_p"])  # typical_p: test_target_typical_p
def test_a_cut_is_refused_outside_zero_to_one_and_crosses_the_wire(tiny_dir, name: str) -> None:
    engine = TargetEngine(load_model(str(tiny_dir), device="cpu", dtype="float32"))
    for value in (-0.1, 1.5, float("nan")):
        with pytest.raises(InvalidArgument, match=rf"{name} must be in \[0, 1\]"):
            engine.prefill("x", prompt_ids(1), SessionConfig(max_new_tokens=4, temperature=1.0, **{name: value}))
    params = SessionParams(SamplingParams(temperature=0.75, **{name: 0.125}), 4)  # both exact in float32
    assert codecs.session_params(codecs.session_params_to_wire(params)) == params
    assert getattr(wire.session_config(codecs.session_params_to_wire(params), False), name) == 0.125
