"""bad_words in the target (target_service.bad_words): each row masked as the one-token step at its
position would be (against vLLM's rule over the generated text, computed here from the model's own
logits), so speculation keeps the answer; a continued session counts its earlier output; bad
values refused; the field over the wire."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.models import load_model
from tandem.rpc import codecs
from tandem.rpc.types import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, Grammar, GrammarKind, SamplingParams, SessionParams
from target_service import wire
from target_service.bad_words import BadWords
from target_service.engine import TargetEngine
from target_service.errors import InvalidArgument
from target_service.session import SessionConfig
from test_target_engine import _prompt as prompt_ids
from test_target_grammar import decode, speculate  # random chains and trees around a guide

NEW = 16


def test_a_rows_mask_follows_the_text_before_it() -> None:
    words = BadWords([(7,), (3, 4), (1, 2, 5), (2, 5), (9, 9, 9)], "cpu")
    logits = torch.zeros(5, 12)  # [rows, vocab]
    # Chain 2, 5, 9 after the generated 8, 1: row 0 follows "8 1", row 1 "8 1 2", row 2 "... 1 2 5"...
    out = words.masked(logits, [8, 1], drafts=[2, 5, 9, 9])
    banned = [sorted(map(int, row.isneginf().nonzero().flatten())) for row in out]
    assert banned == [[7], [5, 7], [7], [7], [7, 9]]  # "1 2" and "2" ban 5; "9 9" bans a third 9
    assert torch.equal(logits, torch.zeros(5, 12))  # a copy
    # A tree after the generated 9: drafts 3 and 9 after the root, 4 after 3, 9 after 9.
    out = words.masked(logits, [9], drafts=[3, 9, 4, 9], parents=[-1, -1, 0, 1])
    banned = [sorted(map(int, row.isneginf().nonzero().flatten())) for row in out]
    assert banned == [[7], [4, 7], [7, 9], [7], [7, 9]]  # rows after "9", "9 3", "9 9", "9 3 4", "9 9 9"
    assert words.masked(logits[:1], [])[0].isneginf().sum() == 1  # nothing generated yet: the single only


@torch.inference_mode()
def banned_greedy(model, prompt: list[int], n: int, sequences: list[tuple[int, ...]], generated: list[int]
                  ) -> list[int]:
    """Greedy decoding under vLLM's rule, one whole forward per step: a sequence's last token is
    masked where the generated text (``generated`` first) ends with the rest of it."""
    out: list[int] = []
    for _ in range(n):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].float()  # [vocab]
        text = generated + out
        for sequence in sequences:
            *before, last = sequence
            if not before or text[len(text) - len(before):] == before and len(text) >= len(before):
                logits[last] = float("-inf")
        out.append(int(logits.argmax()))
    return out


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return load_model(str(tiny_dir), device="cpu", dtype="float32")


@pytest.fixture
def engine(loaded) -> TargetEngine:
    return TargetEngine(loaded)


def test_banned_greedy_decoding_is_the_rule_and_speculation_keeps_it(engine, loaded) -> None:
    prompt = prompt_ids(70)
    plain = decode(engine, prompt, SessionConfig(max_new_tokens=NEW, ignore_eos=True), "plain")
    cases = [
        [(plain[0],)],  # the first token, outright
        [(plain[3], plain[4]), (plain[4], plain[5], plain[6])],  # a token after the text before it
    ]
    for i, sequences in enumerate(cases):
        wanted = banned_greedy(loaded.model, prompt, NEW, sequences, [])
        assert wanted != plain
        config = SessionConfig(max_new_tokens=NEW, ignore_eos=True, bad_words=tuple(sequences))
        assert decode(engine, prompt, config, f"decoded{i}") == wanted
        for seed in range(8):
            guide = (wanted, plain)[seed % 2]  # drafts that follow the answer, or the banned text
            assert speculate(engine, prompt, config, f"sp{i}{seed}", random.Random(seed), guide)[:NEW] == wanted


def test_a_continued_session_counts_its_earlier_output(engine, loaded) -> None:
    prompt = prompt_ids(71)
    plain = decode(engine, prompt, SessionConfig(max_new_tokens=NEW, ignore_eos=True), "plain")
    # The prompt's last three tokens are this generation's own output so far: "... x y" + z is banned.
    earlier = plain[:3]
    sequences = [(earlier[-1], plain[3])]
    config = SessionConfig(max_new_tokens=8, ignore_eos=True, bad_words=tuple(sequences), continued_tokens=3)
    wanted = banned_greedy(loaded.model, prompt + earlier, 8, sequences, earlier)
    assert wanted[0] != plain[3]
    assert decode(engine, prompt + earlier, config, "continued") == wanted
    moved = SessionConfig(max_new_tokens=8, ignore_eos=True, bad_words=tuple(sequences))  # not continued: allowed
    assert decode(engine, prompt + earlier, moved, "fresh")[0] == plain[3]


def test_bad_words_are_refused_by_name_and_cross_the_wire(engine) -> None:
    cases = {
        "outside the vocabulary": ((5, engine.vocab_size),),
        "1 to": ((),),
        f"1 to {MAX_BAD_WORD_TOKENS}": ((5,) * (MAX_BAD_WORD_TOKENS + 1),),
        f"more than the {MAX_BAD_WORDS}": ((5,),) * (MAX_BAD_WORDS + 1),
    }
    for message, sequences in cases.items():
        with pytest.raises(InvalidArgument, match=message):
            engine.prefill("x", prompt_ids(1), SessionConfig(max_new_tokens=4, bad_words=sequences))
    with pytest.raises(InvalidArgument, match="bad_words cannot be combined with a grammar"):
        engine.prefill("x", prompt_ids(1), SessionConfig(max_new_tokens=4, bad_words=((5,),),
                                                         grammar=Grammar(GrammarKind.REGEX, "a+")))
    params = SessionParams(SamplingParams(), 4, bad_words=((5,), (6, 7, 8)))
    assert codecs.session_params(codecs.session_params_to_wire(params)) == params
    assert wire.session_config(codecs.session_params_to_wire(params), False).bad_words == ((5,), (6, 7, 8))
    assert SessionConfig(max_new_tokens=4, bad_words=((5,),)).reshapes_logits
