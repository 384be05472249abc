"""What a target reads off its tokenizer, kept on disk so that a target need not load the tokenizer.

A target uses its tokenizer for three facts only: the fingerprint callers are checked against
(``tokenizer_fingerprint``), its end-of-sequence id, and how its tokens decode (the key of the
grammar compiler's table, ``tandem.grammar.backend_parts``); the table itself is cached by that key.
Loading a large vocabulary's tokenizer takes seconds of every start and keeps hundreds of MB of the
target's memory (figures: docs/target.md#the-targets-tokenizer). So the facts are saved under
``cache_dir()/tokenizer-facts``, in a file named by a hash of the checkpoint folder, the name, size
and modification time of each of its tokenizer files, and the transformers and tokenizers
versions; a target reads them from there and loads the tokenizer (:class:`TokenizerLoader`) only
when a grammar's table must be made.

Invariant: the facts read are the ones :func:`facts_of` gives the tokenizer those files load now
(a file changed, added or removed, or another version reading them, names another cache file).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tandem.files import atomic_write_text
from tandem.models import specs

log = logging.getLogger(__name__)

# The files a Hugging Face tokenizer may be read from (their absence is part of the key too).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "config.json",
                   "generation_config.json")
MAX_RECORDS = 256  # records kept, newest first (each a few hundred bytes)


@dataclass(frozen=True)
class TokenizerFacts:
    fingerprint: str  # tandem.models.tokenizer_fingerprint
    eos_token_id: int | None  # the tokenizer's own (a model may name more: target_service.model_info)
    backend: str | None  # tandem.grammar.backend_parts: how the tokens decode, part of a grammar table's key


class TokenizerLoader:
    """The tokenizer of ``hf_dir``, loaded at the first :meth:`get` (once; thread-safe)."""

    def __init__(self, hf_dir: Path, tokenizer: Any = None) -> None:
        self.hf_dir = Path(hf_dir)
        self._tokenizer = tokenizer
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from tandem.models.loading import load_tokenizer

                self._tokenizer = load_tokenizer(str(self.hf_dir))
            return self._tokenizer

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None


def facts_of(tokenizer: Any) -> TokenizerFacts:
    from tandem.grammar import backend_parts
    from tandem.models.loading import tokenizer_fingerprint

    eos = getattr(tokenizer, "eos_token_id", None)
    return TokenizerFacts(tokenizer_fingerprint(tokenizer), eos if isinstance(eos, int) else None,
                          backend_parts(tokenizer))


def tokenizer_facts(loader: TokenizerLoader) -> TokenizerFacts:
    """The facts of ``loader``'s tokenizer: read from the cache where an earlier start saved them,
    else from the tokenizer (loaded now) and saved. A tokenizer the loader was given is read, not
    cached (it need not be its folder's). A cache that cannot be written is only logged."""
    if loader.loaded:
        return facts_of(loader.get())
    path = _facts_file(loader.hf_dir)
    recorded = _read_record(path)
    if recorded is not None:
        return recorded
    facts = facts_of(loader.get())
    try:
        atomic_write_text(path, json.dumps(asdict(facts)))
        _prune(path.parent)
    except OSError as error:
        log.info("tokenizer facts not cached (%s): the next start loads the tokenizer again", error)
    return facts


def _prune(folder: Path) -> None:
    """Keeps the :data:`MAX_RECORDS` newest records (a folder's records outlive it: checkpoints
    moved, tests' temporary models)."""
    records = sorted(folder.glob("*.json"), key=_mtime, reverse=True)
    for old in records[MAX_RECORDS:]:
        with contextlib.suppress(OSError):  # (another process's prune got there first)
            old.unlink()


def _read_record(path: Path) -> TokenizerFacts | None:
    """The facts recorded at ``path``, else None (no record, or one that does not load)."""
    if not path.is_file():
        return None
    try:
        return TokenizerFacts(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as error:  # a damaged or foreign file: from the tokenizer again
        log.warning("tokenizer facts %s do not load (%s): reading the tokenizer", path, error)
        return None


def _facts_file(hf_dir: Path) -> Path:
    folder = Path(hf_dir).resolve()
    files = []
    for name in TOKENIZER_FILES:
        try:
            stat = (folder / name).stat()
        except FileNotFoundError:
            continue
        files.append([name, stat.st_size, stat.st_mtime_ns])
    key = json.dumps([str(folder), files, importlib.metadata.version("transformers"),
                      importlib.metadata.version("tokenizers")])
    return specs.cache_dir() / "tokenizer-facts" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:  # removed meanwhile
        return 0
