"""Other servers' ways to ask for structured output, read as the grammar ``response_format`` gives.

Clients written for vLLM send ``guided_json``, ``guided_regex``, ``guided_choice`` or
``guided_grammar`` (or, since vLLM 0.10, ``structured_outputs`` with one of ``json``, ``regex``,
``choice``, ``grammar``, ``json_object``); clients written for llama.cpp's server send ``json_schema``
or ``grammar`` (GBNF). Each names a grammar tandem already keeps through speculation
(``gateway.response_format``, docs/structured-output.md), so the chat and completions routes take
them as they are rather than refusing them. A choice is a grammar of its strings, each matched
whole. Asking two ways at once (two of these, or one and ``response_format``) is refused: which
would win is not obvious.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.errors import InvalidRequest
from tandem.rpc.types import Grammar, GrammarKind

# top-level field -> the kind of thing it holds (vLLM's structured_outputs keys use the same words)
FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
          "json_schema": "json", "grammar": "grammar", "structured_outputs": "structured_outputs"}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def grammar_of(extra: Mapping[str, Any]) -> tuple[Grammar, str] | None:
    """The grammar these fields of a request body ask for, and the field that asked; None where none
    of them is set (null is not set)."""
    given = [name for name in FIELDS if extra.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(f"ask for structured output one way, not with {' and '.join(given)}", param=given[1])
    name = given[0]
    kind, value = FIELDS[name], extra[name]
    if kind == "structured_outputs":
        if not isinstance(value, dict):
            raise InvalidRequest(f"{name} must be an object with one of {', '.join(_KINDS)}", param=name)
        set_kinds = [k for k in _KINDS if value.get(k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequest(f"{name} must set exactly one of {', '.join(_KINDS)}, got "
                                 f"{', '.join(set_kinds) or 'none'}", param=name)
        kind, value = set_kinds[0], value[set_kinds[0]]
    return _grammar(kind, value, name), name


def _grammar(kind: str, value: Any, name: str) -> Grammar:
    if kind == "json_object":
        return Grammar(GrammarKind.JSON_SCHEMA, '{"type": "object"}')
    if kind == "json":
        if isinstance(value, str):  # a schema as JSON text, as vLLM takes it
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequest(f"{name}: the schema is not JSON: {exc}", param=name) from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequest(f"{name} must be a JSON Schema (an object)", param=name)
        return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(value))
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise InvalidRequest(f"{name} must be a list of non-empty strings", param=name)
        return Grammar(GrammarKind.EBNF, "root ::= " + " | ".join(_literal(c) for c in value))
    if not (isinstance(value, str) and value):
        raise InvalidRequest(f"{name} must be a non-empty string", param=name)
    return Grammar(GrammarKind.REGEX if kind == "regex" else GrammarKind.EBNF, value)


def _literal(text: str) -> str:
    """``text`` as a GBNF string literal (quoted, with its backslashes, quotes and control characters
    escaped)."""
    escaped = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return '"' + "".join(escaped.get(c, f"\\x{ord(c):02x}" if ord(c) < 0x20 else c) for c in text) + '"'


__all__ = ["FIELDS", "grammar_of"]
