"""A target reads its tokenizer's facts (fingerprint, end of sequence, how tokens decode) from the
cache after its first start, and loads the tokenizer only where a grammar's table must be made: the
same facts, the same Info, the same constrained decoding."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from tandem.config import TargetSettings
from tandem.models import load_tokenizer, loading, tokenizer_facts as facts_module
from tandem.models.tokenizer_facts import TokenizerLoader, facts_of, tokenizer_facts
from tandem.rpc.types import Grammar, GrammarKind
from target_service.engine import TargetEngine
from target_service.session import SessionConfig
from test_target_engine import _prompt as prompt_ids
from test_target_grammar import decode


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def forbid_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "load_tokenizer", lambda *_: pytest.fail("the tokenizer should not be loaded"))


def test_facts_are_read_from_the_tokenizer_once_then_from_the_cache(tiny_gemma_dir, cache, monkeypatch) -> None:
    expected = facts_of(load_tokenizer(str(tiny_gemma_dir)))
    first = TokenizerLoader(tiny_gemma_dir)
    assert tokenizer_facts(first) == expected and first.loaded
    forbid_loading(monkeypatch)
    again = TokenizerLoader(tiny_gemma_dir)
    assert tokenizer_facts(again) == expected and not again.loaded
    assert expected.fingerprint and expected.backend and expected.eos_token_id is not None


def test_a_changed_tokenizer_file_or_a_damaged_record_reads_the_tokenizer_again(tiny_gemma_dir, cache, tmp_path,
                                                                                  caplog) -> None:
    folder = Path(shutil.copytree(tiny_gemma_dir, tmp_path / "model"))
    before = tokenizer_facts(TokenizerLoader(folder))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token"] = config["bos_token"]  # another end of sequence: another fingerprint
    config_file.write_text(json.dumps(config))
    after = TokenizerLoader(folder)
    assert tokenizer_facts(after) == facts_of(load_tokenizer(str(folder))) != before and after.loaded

    (record,) = [p for p in (cache / "tokenizer-facts").iterdir() if json.loads(p.read_text()) == after_dict(after)]
    record.write_text("{not json")
    reread = TokenizerLoader(folder)
    with caplog.at_level(logging.WARNING, logger=facts_module.__name__):
        assert tokenizer_facts(reread) == facts_of(reread.get())
    assert "do not load" in caplog.text and json.loads(record.read_text()) == after_dict(reread)


def after_dict(loader: TokenizerLoader) -> dict:
    from dataclasses import asdict

    return asdict(facts_of(loader.get()))


def test_a_given_tokenizer_is_read_not_recorded(tiny_gemma_dir, cache) -> None:
    tokenizer = load_tokenizer(str(tiny_gemma_dir))
    assert tokenizer_facts(TokenizerLoader(tiny_gemma_dir, tokenizer)) == facts_of(tokenizer)
    assert not (cache / "tokenizer-facts").exists()


def test_a_target_restarted_serves_the_same_without_loading_its_tokenizer(tiny_gemma_dir, cache, monkeypatch) -> None:
    settings = TargetSettings(target_model=str(tiny_gemma_dir), device="cpu", dtype="float32", kv_cache_memory_gb=0.1)
    config = SessionConfig(max_new_tokens=6, grammar=Grammar(GrammarKind.REGEX, "(cat|dog|fish)(s|es)?"))
    fingerprint = facts_of(load_tokenizer(str(tiny_gemma_dir))).fingerprint

    def served(engine: TargetEngine) -> tuple:
        engine.warmup()  # the grammar compiler's table, from the cache after the first start
        return engine.info, decode(engine, prompt_ids(8), config, "constrained")

    expected = served(TargetEngine.from_settings(settings))
    assert expected[0].tokenizer_fingerprint == fingerprint
    forbid_loading(monkeypatch)
    assert served(TargetEngine.from_settings(settings)) == expected


def test_only_the_newest_records_are_kept(tiny_gemma_dir, cache, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(facts_module, "MAX_RECORDS", 2)
    folders = [Path(shutil.copytree(tiny_gemma_dir, tmp_path / f"model-{i}")) for i in range(3)]
    for folder in folders:
        tokenizer_facts(TokenizerLoader(folder))
    assert len(list((cache / "tokenizer-facts").iterdir())) == 2
    forbid_loading(monkeypatch)
    newest = TokenizerLoader(folders[2])
    assert tokenizer_facts(newest).fingerprint and not newest.loaded  # its record kept: read, not loaded


def test_a_cache_that_cannot_be_written_only_costs_the_tokenizer_load(tiny_gemma_dir, cache, caplog) -> None:
    cache.mkdir(parents=True)
    (cache / "tokenizer-facts").write_text("a file where the folder would be")  # unwritable, even for root
    loader = TokenizerLoader(tiny_gemma_dir)
    with caplog.at_level(logging.INFO, logger=facts_module.__name__):
        assert tokenizer_facts(loader) == facts_of(loader.get())
    assert "not cached" in caplog.text


async def test_a_gateway_reads_the_fingerprint_its_target_recorded(tiny_gemma_dir, cache, monkeypatch) -> None:
    """The gateway loads the tokenizer (it tokenizes every request) but takes the fingerprint it
    checks targets and drafts against from the record, once one start has made it."""
    from gateway import served_model
    from gateway.main import start_gateway
    from tandem.config import GatewaySettings

    expected = facts_of(load_tokenizer(str(tiny_gemma_dir))).fingerprint
    settings = GatewaySettings(target_model=str(tiny_gemma_dir), target_address="127.0.0.1:9",
                               draft_address="127.0.0.1:9", http_port=0, grpc_port=0, log_level="warning")
    for start in ("first", "again"):
        gateway = await start_gateway(settings, max_context_len=512)
        try:
            assert gateway.core.model.fingerprint == expected, start
            assert gateway.core.model.tokenizer("hello").input_ids
        finally:
            await gateway.stop()
        monkeypatch.setattr(served_model, "tokenizer_fingerprint", lambda *_: pytest.fail("computed again"))
        monkeypatch.setattr(facts_module, "facts_of", lambda *_: pytest.fail("read off the tokenizer again"))
