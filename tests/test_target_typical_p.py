"""typical_p in the target (target_service.typical_p): the cut against its definition (sorted, in
float64) and against Hugging Face's warper, masked tokens and ties, greedy sessions untouched, a
near-zero typical_p's one token through speculation. Bad values and the wire: test_target_min_p;
speculation keeping the cut distribution: with the other samplers (test_target_sampling)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import TypicalLogitsWarper

from tandem.models import load_model
from target_service import typical_p
from target_service.engine import TargetEngine
from target_service.session import SessionConfig
from test_target_engine import _prompt as prompt_ids
from test_target_grammar import decode, speculate


def typical_kept(logits: torch.Tensor, temperature: float, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, row by row in float64 with a full sort: which tokens are kept [rows, vocab],
    and how many of each row's tokens have a running mass within 2e-6 of ``mass`` [rows] (those a
    float32 sum may place on the other side of the cut)."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)  # [rows, vocab]
    probs = logp.exp()
    entropy = -(probs * logp).nansum(dim=-1, keepdim=True)  # [rows, 1]
    distance = (-logp - entropy).abs()  # [rows, vocab]
    order = distance.argsort(dim=-1, stable=True)  # [rows, vocab]
    running = probs.gather(-1, order).cumsum(-1)  # [rows, vocab]
    last = (running < mass).sum(-1, keepdim=True).clamp(max=logits.shape[-1] - 1)  # [rows, 1]
    threshold = distance.gather(-1, order.gather(-1, last))  # [rows, 1]
    return distance <= threshold, ((running - mass).abs() < 2e-6).sum(-1)


@pytest.mark.parametrize("temperature", [0.4, 1.0, 1.7])
@pytest.mark.parametrize("mass", [0.05, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("spread", [1.0, 4.0, 12.0])
def test_the_cut_is_the_smallest_prefix_nearest_the_entropy_that_reaches_the_mass(
    temperature: float, mass: float, spread: float
) -> None:
    generator = torch.Generator().manual_seed(int(temperature * 10 + mass * 100 + spread))
    logits = torch.randn(6, 3000, generator=generator) * spread  # [rows, vocab]
    logits[3, :2000] = float("-inf")  # already masked (a grammar's): stays masked, the rest is cut as usual
    given = logits.clone()
    out = typical_p.masked(logits, temperature, mass)
    wanted, edge = typical_kept(logits, temperature, mass)
    clear = edge == 0  # rows whose cut float32 and float64 sums cannot place apart
    assert torch.equal(out.isfinite()[clear], wanted[clear])
    for row in (~clear).nonzero().flatten().tolist():  # both prefixes of one order, apart by edge tokens at most
        small, large = sorted((out[row].isfinite(), wanted[row]), key=lambda kept: int(kept.sum()))
        assert bool((small <= large).all()) and int(large.sum() - small.sum()) <= int(edge[row])
    assert torch.equal(out[out.isfinite()], logits[out.isfinite()])  # kept logits unchanged
    assert out[3, :2000].isneginf().all() and out.isfinite().sum(dim=-1).min() >= 1
    assert torch.equal(logits, given)  # a copy
    warped = TypicalLogitsWarper(mass)(None, (logits.double() / temperature))  # Hugging Face's, float64 input
    assert torch.equal(out.isfinite()[clear], warped.isfinite()[clear])


def test_ties_with_the_last_token_stay_and_the_most_probable_token_may_go() -> None:
    # One token at probability 0.21, 199 at 0.004 each: the top token's surprisal is farther from the
    # entropy than theirs (as for any top token below one half against an even rest).
    logits = torch.zeros(1, 200)  # [1, vocab]
    logits[0, 0] = 4.0
    out = typical_p.masked(logits, 1.0, 0.2)
    assert out[0, 0].isneginf() and out[0, 1:].isfinite().all()  # the 199 equal tokens: ties, all kept
    assert typical_p.masked(logits, 1.0, 1e-6)[0, 1:].isfinite().all()  # ties even at a near-zero mass


def test_a_long_flat_row_and_a_row_with_nothing_left() -> None:
    flat = torch.randn(2, 262144, generator=torch.Generator().manual_seed(5)) * 0.5  # [rows, vocab]
    flat[1] = float("-inf")
    out = typical_p.masked(flat, 1.0, 0.8)
    wanted, _ = typical_kept(flat[:1], 1.0, 0.8)
    assert abs(int(out[0].isfinite().sum()) - int(wanted.sum())) <= 3  # ~170,000 kept; rounding at the edge
    assert out[1].isneginf().all()


def test_only_sampled_sessions_with_a_mass_below_one_are_cut() -> None:
    assert not SessionConfig(max_new_tokens=4, typical_p=0.5).reshapes_logits  # greedy
    assert SessionConfig(max_new_tokens=4, temperature=0.7, typical_p=0.5).reshapes_logits
    assert not SessionConfig(max_new_tokens=4, temperature=0.7, typical_p=1.0).reshapes_logits
    assert not SessionConfig(max_new_tokens=4, temperature=0.7).reshapes_logits


@torch.inference_mode()
def _most_typical_each_step(model, prompt: list[int], steps: int) -> list[int]:
    """What a near-zero typical_p samples: at each step the one token nearest the entropy, from
    uncached forward passes and the float64 definition."""
    tokens: list[int] = []
    for _ in range(steps):
        logits = model(torch.tensor([prompt + tokens])).logits[:, -1].float()  # [1, vocab]
        kept, _ = typical_kept(logits, 0.8, 1e-9)
        assert int(kept.sum()) == 1
        tokens.append(int(kept[0].nonzero()))
    return tokens


def test_a_near_zero_typical_p_samples_the_most_typical_token_decoded_or_verified(tiny_dir) -> None:
    loaded = load_model(str(tiny_dir), device="cpu", dtype="float32")
    engine = TargetEngine(loaded)
    prompt = prompt_ids(90)
    wanted = _most_typical_each_step(loaded.model, prompt, 10)
    greedy = decode(engine, prompt, SessionConfig(max_new_tokens=10, ignore_eos=True), "greedy")
    assert wanted != greedy  # the most typical token is not the most probable one
    one = SessionConfig(max_new_tokens=10, ignore_eos=True, temperature=0.8, typical_p=1e-9, seed=3)
    assert decode(engine, prompt, one, "decoded") == wanted
    for seed in range(2):
        guide = (wanted, greedy)[seed]  # drafts that follow the answer, then ones that do not
        assert speculate(engine, prompt, one, f"sp{seed}", random.Random(seed), guide)[:10] == wanted
