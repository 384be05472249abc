"""Incremental detokenization: no broken characters, and nothing lost or added."""

from __future__ import annotations

import random

import pytest

from gateway.detokenizer import IncrementalDetokenizer
from gateway_fakes import SCRIPT_TEXT


def detokenize(tok, ids, context=()):
    detok = IncrementalDetokenizer(tok, context_ids=context)
    deltas = [detok.push(i) for i in ids]
    return deltas, detok.flush()


def test_multibyte_characters_split_across_tokens_are_never_emitted_broken(tokenizer):
    ids = tokenizer(SCRIPT_TEXT, add_special_tokens=False)["input_ids"]
    # The premise: some single tokens are parts of characters and decode to U+FFFD alone.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    deltas, rest = detokenize(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert rest == ""
    assert "".join(deltas) == tokenizer.decode(ids) == SCRIPT_TEXT


def test_text_is_held_back_until_the_character_completes(tokenizer):
    ids = tokenizer("日", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1
    deltas, rest = detokenize(tokenizer, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "日" and rest == ""


def test_flush_releases_an_incomplete_trailing_character(tokenizer):
    ids = tokenizer("ok 日", add_special_tokens=False)["input_ids"][:-1]
    deltas, rest = detokenize(tokenizer, ids)
    assert "".join(deltas) == "ok "
    assert rest.startswith("\ufffd")
    assert "".join(deltas) + rest == tokenizer.decode(ids)


def test_prompt_context_is_used_but_never_emitted(tokenizer):
    prompt = tokenizer("héllo wörld", add_special_tokens=False)["input_ids"]
    ids = tokenizer(" ✓ 日本語 🙂", add_special_tokens=False)["input_ids"]
    deltas, rest = detokenize(tokenizer, ids, context=prompt)
    assert "".join(deltas) + rest == " ✓ 日本語 🙂"


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer("Hi there", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    deltas, rest = detokenize(tokenizer, ids)
    assert "".join(deltas) + rest == "Hi there"


@pytest.mark.parametrize("seed", range(5))
def test_any_token_sequence_concatenates_to_the_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(3, len(tokenizer)) for _ in range(200)]  # 0..2 are special tokens
    deltas, rest = detokenize(tokenizer, ids)
    assert "".join(deltas) + rest == tokenizer.decode(ids)
    assert all(not d.endswith("\ufffd") for d in deltas)
