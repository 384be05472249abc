"""Penalties on repeats in the target (OpenAI's presence and frequency penalties, the repetition
penalty of HF transformers, vLLM and TGI): each row scored as the one-token step at its position
would be (against the formulas over the prompt and generated tokens, computed here from the model's
own logits), so speculation keeps the penalised answer; on tiny float and quantized targets."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tandem.models import load_model
from tandem.rpc import codecs
from tandem.rpc.types import SamplingParams, SessionParams
from tandem.v1 import common_pb2
from target_service import wire
from target_service.engine import TargetEngine
from target_service.errors import InvalidArgument
from target_service.penalties import Penalties
from target_service.session import SessionConfig
from test_quant_model import quantized_gemma  # noqa: F401 (a fixture)
from test_target_engine import _prompt as prompt_ids
from test_target_grammar import decode, speculate  # random chains and trees around a guide

NEW = 24


@pytest.fixture(scope="module", params=["llama", "gemma"])
def loaded(request, tiny_dir, tiny_gemma_dir):
    return load_model(str(tiny_dir if request.param == "llama" else tiny_gemma_dir), device="cpu", dtype="float32")


@torch.inference_mode()
def penalised_greedy(model, prompt: list[int], n: int, presence: float, frequency: float,
                     repetition: float = 1.0) -> list[int]:
    """Greedy decoding with the penalties applied as OpenAI and HF transformers document them, one
    whole forward per step."""
    out: list[int] = []
    for _ in range(n):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].float()  # [vocab]
        seen = sorted(set(prompt + out))
        held = logits[seen]  # [seen]
        logits[seen] = torch.where(held > 0, held / repetition, held * repetition)
        for token, count in Counter(out).items():
            logits[token] -= presence + frequency * count
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(("presence", "frequency", "repetition"),
                         [(0.0, 1.5, 1.0), (1.0, 0.5, 1.0), (-1.0, 0.0, 1.0), (0.0, 0.0, 1.5), (0.5, 0.5, 1.2),
                          (0.0, 0.0, 0.5)])
def test_penalised_greedy_decoding_is_the_formulas_and_speculation_keeps_it(loaded, presence, frequency,
                                                                            repetition) -> None:
    engine = TargetEngine(loaded)
    prompt = prompt_ids(70)
    config = SessionConfig(max_new_tokens=NEW, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency,
                           repetition_penalty=repetition)
    tokens = decode(engine, prompt, config, "ar")
    assert tokens == penalised_greedy(loaded.model, prompt, NEW, presence, frequency, repetition)
    assert tokens != decode(engine, prompt, SessionConfig(max_new_tokens=NEW, ignore_eos=True), "plain")
    for seed in range(3):
        assert speculate(engine, prompt, config, f"sp{seed}", random.Random(seed), tokens)[:NEW] == tokens


def test_the_quantized_target_keeps_its_penalised_answer_speculating(quantized_gemma) -> None:
    engine = TargetEngine(quantized_gemma)
    prompt = prompt_ids(71)
    config = SessionConfig(max_new_tokens=NEW, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.8,
                           repetition_penalty=1.3)
    tokens = decode(engine, prompt, config, "ar")
    for seed in range(2):
        assert speculate(engine, prompt, config, f"sp{seed}", random.Random(seed), tokens)[:NEW] == tokens


def test_each_row_of_a_tree_counts_its_own_path() -> None:
    penalties = Penalties(0.5, 1.0, 8, "cpu", generated=[3, 3, 5])
    logits = torch.zeros(4, 8)  # rows: root, then drafts 3 (root's child), 5 (child of the 3), 3 (root's child)
    out = penalties.applied(logits, drafts=[3, 5, 3], parents=[-1, 0, -1])
    base = torch.zeros(8)
    base[3], base[5] = -(0.5 + 2.0), -(0.5 + 1.0)
    assert torch.equal(out[0], base)
    assert out[1, 3] == -(0.5 + 3.0) and out[1, 5] == base[5]  # after [3]
    assert out[2, 3] == -(0.5 + 3.0) and out[2, 5] == -(0.5 + 2.0)  # after [3, 5]
    assert torch.equal(out[3], out[1])  # the other branch's [3]
    fresh = Penalties(0.5, 1.0, 8, "cpu").applied(torch.zeros(2, 8), drafts=[6])
    assert fresh[1, 6] == -1.5 and fresh[0, 6] == 0.0  # presence counts from the token's first occurrence
    # The repetition penalty: the prompt counts too, and each row its own path.
    repeats = Penalties(0.0, 0.0, 8, "cpu", generated=[3], repetition=2.0, prompt=[1, 3])
    signs = torch.tensor([1.0, -1.0] * 4).expand(4, 8)  # [rows, vocab]: logits +1 / -1
    out = repeats.applied(signs, drafts=[6, 7, 4], parents=[-1, 0, -1])
    for row, tokens in enumerate(({1, 3}, {1, 3, 6}, {1, 3, 6, 7}, {1, 3, 4})):
        want = torch.tensor([(1.0 if t % 2 == 0 else -1.0) * ((0.5 if t % 2 == 0 else 2.0) if t in tokens else 1.0)
                             for t in range(8)])
        assert torch.equal(out[row], want), (row, out[row])


def test_a_continued_session_counts_the_output_it_continues(loaded) -> None:
    engine = TargetEngine(loaded)
    prompt = prompt_ids(72)
    config = SessionConfig(max_new_tokens=NEW, ignore_eos=True, frequency_penalty=1.2)
    whole = decode(engine, prompt, config, "first")
    cut = NEW // 2
    moved = SessionConfig(max_new_tokens=NEW - cut, ignore_eos=True, frequency_penalty=1.2, continued_tokens=cut)
    assert whole[:cut] + decode(engine, prompt + whole[:cut], moved, "moved") == whole


def test_penalties_are_refused_outside_their_range_and_cross_the_wire(loaded) -> None:
    engine = TargetEngine(loaded)
    for value in (2.5, -3.0, float("nan")):
        with pytest.raises(InvalidArgument, match="presence_penalty must be in"):
            engine.prefill("x", prompt_ids(1), SessionConfig(max_new_tokens=4, presence_penalty=value))
    for value in (0.0, -1.0, 2.5, float("inf")):
        with pytest.raises(InvalidArgument, match="repetition_penalty must be in"):
            engine.prefill("x", prompt_ids(1), SessionConfig(max_new_tokens=4, repetition_penalty=value))
    params = SessionParams(SamplingParams(), 4, presence_penalty=0.25, frequency_penalty=-0.5, continued_tokens=2,
                           repetition_penalty=1.25)
    assert codecs.session_params(codecs.session_params_to_wire(params)) == params
    config = wire.session_config(codecs.session_params_to_wire(params), False)
    assert (config.presence_penalty, config.frequency_penalty, config.continued_tokens) == (0.25, -0.5, 2)
    assert config.repetition_penalty == 1.25
    unset = codecs.session_params(common_pb2.SessionParams(max_new_tokens=4))
    assert unset.repetition_penalty == 1.0  # a message without it (an older sender's): none
