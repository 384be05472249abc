"""The grammar compiler's tokenizer table is made once per tokenizer and read back from the cache
afterwards: the same table (every token's bytes, the vocabulary's kind, stop and special ids) and
so the same masks, on the real Gemma 3 tokenizer and a tiny one."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import xgrammar

from tandem import grammar
from tandem.grammar import GrammarCompiler, tokenizer_table
from tandem.models import load_tokenizer, tokenizer_fingerprint
from tandem.rpc.types import Grammar, GrammarKind

SCHEMA = Grammar(GrammarKind.JSON_SCHEMA, '{"type": "object", "properties": {"ok": {"type": "boolean"}}}')


def described(info) -> tuple:
    return (info.vocab_size, info.vocab_type, info.add_prefix_space, info.decoded_vocab, info.stop_token_ids,
            info.special_token_ids)


def tables_dir(cache: Path) -> Path:
    return cache / "grammar-tables"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module", params=["gemma-3-270m", "tiny-gemma"])
def tokenizer(request, tiny_gemma_dir):
    return load_tokenizer(request.param if request.param == "gemma-3-270m" else str(tiny_gemma_dir))


def forbid_making(monkeypatch: pytest.MonkeyPatch) -> None:
    def made(*_args, **_kwargs):
        raise AssertionError("the table should have been read from the cache")

    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", made)


def test_a_table_is_made_once_and_read_back_the_same(tokenizer, cache, monkeypatch) -> None:
    vocab, eos = len(tokenizer), [tokenizer.eos_token_id]
    fingerprint = tokenizer_fingerprint(tokenizer)
    made = tokenizer_table(tokenizer, vocab, eos, fingerprint)
    assert len(list(tables_dir(cache).iterdir())) == 1

    forbid_making(monkeypatch)
    read = tokenizer_table(tokenizer, vocab, eos, fingerprint)
    assert described(read) == described(made) and read.serialize_json() == made.serialize_json()
    if vocab > 100_000:
        return  # equal tables, equal masks (compiling a schema twice for 262k ids would take seconds)
    # The same masks along a schema's text, from a compiler on either table.
    masks = []
    for info in (made, read):
        matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_json_schema(SCHEMA.spec))
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        rows = []
        for token in tokenizer.encode('{"ok": true}', add_special_tokens=False):
            matcher.fill_next_token_bitmask(bitmask)
            rows.append(bitmask.clone())
            assert matcher.accept_token(token)
        masks.append(rows)
    assert all(bool((a == b).all()) for a, b in zip(*masks, strict=True))


def test_the_table_is_keyed_by_all_it_is_made_from(tiny_gemma_dir, cache) -> None:
    tokenizer = load_tokenizer(str(tiny_gemma_dir))
    vocab, eos = len(tokenizer), [tokenizer.eos_token_id]
    fingerprint = tokenizer_fingerprint(tokenizer)
    tokenizer_table(tokenizer, vocab, eos, fingerprint)
    tokenizer_table(tokenizer, vocab + 64, eos, fingerprint)  # a model whose head is padded
    other_stop = tokenizer_table(tokenizer, vocab, [*eos, 0], fingerprint)
    assert sorted(other_stop.stop_token_ids) == sorted([*eos, 0])
    assert len(list(tables_dir(cache).iterdir())) == 3
    tokenizer_table(tokenizer, vocab, eos, None)  # no fingerprint: made, not kept
    assert len(list(tables_dir(cache).iterdir())) == 3


def test_a_damaged_table_is_made_again_and_an_unwritable_cache_only_logged(tiny_gemma_dir, cache, caplog) -> None:
    tokenizer = load_tokenizer(str(tiny_gemma_dir))
    vocab, eos, fingerprint = len(tokenizer), [tokenizer.eos_token_id], tokenizer_fingerprint(tokenizer)
    expected = described(tokenizer_table(tokenizer, vocab, eos, fingerprint))
    (path,) = tables_dir(cache).iterdir()
    path.write_text('{"not": "a table"')
    with caplog.at_level(logging.WARNING, logger=grammar.__name__):
        assert described(tokenizer_table(tokenizer, vocab, eos, fingerprint)) == expected
    assert "does not load" in caplog.text
    assert described(xgrammar.TokenizerInfo.deserialize_json(path.read_text())) == expected  # written again

    path.unlink()
    tables_dir(cache).rmdir()
    tables_dir(cache).write_text("a file where the folder would be")  # unwritable, even for root
    with caplog.at_level(logging.INFO, logger=grammar.__name__):
        assert described(tokenizer_table(tokenizer, vocab, eos, fingerprint)) == expected
    assert "not cached" in caplog.text


def test_the_compiler_reads_the_cached_table(tiny_gemma_dir, cache, monkeypatch) -> None:
    tokenizer = load_tokenizer(str(tiny_gemma_dir))
    vocab, eos, fingerprint = len(tokenizer), [tokenizer.eos_token_id], tokenizer_fingerprint(tokenizer)
    GrammarCompiler(tokenizer, vocab, eos, fingerprint).compile(SCHEMA)
    forbid_making(monkeypatch)
    assert GrammarCompiler(tokenizer, vocab, eos, fingerprint).compile(SCHEMA) is not None
