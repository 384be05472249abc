"""Grammars compiled against a tokenizer (xgrammar), the same way in every service.

The target masks a constrained session's rows with them (``target_service.grammar``) and the draft
guides its proposals with them (``draft_service.guide``): both must read a grammar alike, so the
options are fixed here. A JSON Schema means what JSON Schema says (properties a schema does not
forbid are allowed), written compactly: ", " and ": " between items, no other whitespace, which
leaves a small model no room to wander in blank space and makes the text's punctuation certain.

Invariant: a matcher has accepted exactly the generated tokens of its session; it is advanced by
committed tokens only, and whatever is tried ahead of them is rolled back.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

from tandem.files import atomic_write_text
from tandem.rpc.types import Grammar, GrammarKind

log = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped): a JSON schema's takes 5-20 MB with a
# vocabulary of 262k, and compiling it again a second or two.
CACHE_BYTES = 512 * 2**20


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message says why (for the caller)."""


def check_json_schema(schema: str) -> None:
    """Raises :class:`GrammarError` for a JSON Schema that no tokenizer's compiler would take (no
    tokenizer needed: a quick check where one is not at hand)."""
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=False)
    except Exception as error:  # noqa: BLE001 (as in GrammarCompiler.compile)
        raise GrammarError(_reason(error)) from error


def array_or_text(schema: str) -> str:
    """An EBNF grammar (GBNF notation, rule ``root``) of either a JSON array under ``schema`` or text
    whose first character other than white space is not ``[`` (white space alone, or nothing, too):
    so that character says which it is. (A chat turn's first token often carries a space.)"""
    import xgrammar

    array = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=False)
    spaced = xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf("root ::= [ \\t\\n]*"), array)
    text = xgrammar.Grammar.from_ebnf("root ::= [ \\t\\n]* ([^[ \\t\\n] [^\\0]*)?")
    return str(xgrammar.Grammar.union(spaced, text))


def _reason(error: Exception) -> str:
    """xgrammar's message without its time and source location (``[12:00:00] /x/y.cc:12: ``)."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text.splitlines()[-1])[:500]


class GrammarCompiler:
    """Compiles grammars against one tokenizer; thread-safe.

    The tokenizer's table (about a second for a vocabulary of 262k) is made at the first grammar,
    read from :func:`tokenizer_table`'s cache when ``fingerprint`` (``tandem.models.
    tokenizer_fingerprint`` of ``tokenizer``) is given; compiled grammars are cached by xgrammar (up
    to :data:`CACHE_BYTES`), so a grammar seen before costs a lookup.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 fingerprint: str | None = None, backend: str | None = None) -> None:
        """``tokenizer``: the tokenizer or a ``TokenizerLoader`` of it; ``fingerprint`` and
        ``backend``: :func:`tokenizer_table`'s."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._fingerprint = fingerprint
        self._backend = backend
        self._compiler: Any = None
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar) -> Any:
        """The compiled grammar (an ``xgrammar.CompiledGrammar``); :class:`GrammarError` says what is wrong."""
        compiler = self._get_compiler()
        try:
            if grammar.kind is GrammarKind.JSON_SCHEMA:
                json.loads(grammar.spec)  # a clear error for text that is not JSON at all
                return compiler.compile_json_schema(grammar.spec, any_whitespace=False, strict_mode=False)
            if grammar.kind is GrammarKind.REGEX:
                return compiler.compile_regex(grammar.spec)
            return compiler.compile_grammar(grammar.spec)
        except Exception as error:  # noqa: BLE001 (xgrammar raises RuntimeError/ValueError for a bad spec)
            raise GrammarError(f"grammar: this {grammar.kind.value} cannot be compiled: {_reason(error)}") from error

    def prepare(self) -> None:
        """Builds the tokenizer's table now (else the first grammar pays for it)."""
        self._get_compiler()

    def matcher(self, grammar: Grammar, generated: Sequence[int] = ()) -> Any:
        """A matcher (``xgrammar.GrammarMatcher``) past ``generated``, the output so far (of an
        earlier session this one continues: ``SessionParams.continued_tokens``)."""
        import xgrammar

        matcher = xgrammar.GrammarMatcher(self.compile(grammar))
        if not all(matcher.accept_token(int(t)) for t in generated):
            raise GrammarError(f"grammar: the {len(generated)} tokens the session continues (continued_tokens) are "
                               "not text the grammar allows")
        return matcher

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                started = time.perf_counter()
                info = tokenizer_table(self._tokenizer, self.vocab_size, self._eos, self._fingerprint, self._backend)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
                log.info("grammar compiler ready in %.2f s (vocabulary %d)", time.perf_counter() - started,
                         self.vocab_size)
            return self._compiler


def backend_parts(tokenizer: Any) -> str | None:
    """How ``tokenizer`` turns ids into text beyond its vocabulary (its normalizer, pre-tokenizer
    and decoder, which decide how xgrammar decodes each token), as text for a table's key; None for a
    tokenizer without a ``tokenizers`` backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    parts = [getattr(backend, part) for part in ("normalizer", "pre_tokenizer", "decoder")]
    return json.dumps([None if part is None else part.__getstate__().decode("utf-8", "replace") for part in parts])


def tokenizer_table(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], fingerprint: str | None,
                    backend: str | None = None) -> Any:
    """xgrammar's table of ``tokenizer`` (an ``xgrammar.TokenizerInfo``): read from the cache folder
    ``grammar-tables`` of ``tandem.models.cache_dir()`` where an earlier process saved it, else made
    (most of it Python walking the vocabulary: about a second at 262k ids, on every start of a
    target) and saved there. Without ``fingerprint`` it is made and not saved. ``tokenizer`` may be
    a ``tandem.models.tokenizer_facts.TokenizerLoader``, loaded only where the table is made or
    ``backend`` (:func:`backend_parts` of it) is not given.

    The file's name hashes all that the table is made from: the tokenizer's fingerprint (vocabulary
    and special ids), :func:`backend_parts`, ``vocab_size``, the stop ids and xgrammar's version; a
    file that fails to load is made again. A cache that cannot be written is only logged."""
    import xgrammar

    from tandem.models.tokenizer_facts import TokenizerLoader

    def loaded() -> Any:
        return tokenizer.get() if isinstance(tokenizer, TokenizerLoader) else tokenizer

    def made() -> Any:
        return xgrammar.TokenizerInfo.from_huggingface(loaded(), vocab_size=vocab_size,
                                                       stop_token_ids=list(eos_token_ids))

    if backend is None and fingerprint is not None:
        backend = backend_parts(loaded())
    if fingerprint is None or backend is None:
        return made()
    from tandem.models import cache_dir

    key = json.dumps([fingerprint, vocab_size, sorted(set(eos_token_ids)), importlib.metadata.version("xgrammar"),
                      backend])
    path = cache_dir() / "grammar-tables" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    if path.is_file():
        try:
            return xgrammar.TokenizerInfo.deserialize_json(path.read_text(encoding="utf-8"))
        except Exception as error:  # noqa: BLE001 (a damaged or foreign file: make the table again)
            log.warning("grammar table %s does not load (%s): making it again", path, _reason(error))
    info = made()
    try:
        atomic_write_text(path, info.serialize_json())
    except OSError as error:
        log.info("grammar table not cached (%s): the next start makes it again", error)
    return info
