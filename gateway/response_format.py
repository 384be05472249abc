"""``response_format``: the structured output a generation request asks for, as the grammar its
answer must match (the target and the draft keep it; docs/structured-output.md).

OpenAI's ``text``, ``json_object`` and ``json_schema``, and two of tandem's own, ``{"type":
"regex", "regex": ...}`` and ``{"type": "grammar", "grammar": ...}`` (EBNF in GBNF notation, rule
``root``); the chat and completions routes take it as it is, the Responses API as ``text.format``.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import InvalidRequest
from tandem.rpc.types import Grammar, GrammarKind


class _StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class JsonSchemaFormat(_StrictBody):
    name: str | None = None
    description: str | None = None
    # A JSON Schema document (``schema`` on the wire; the name would shadow pydantic's own).
    json_schema: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is followed exactly either way


class ResponseFormat(_StrictBody):
    type: str
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None  # tandem's: for "type": "regex"
    grammar: str | None = None  # tandem's: for "type": "grammar"

    def to_grammar(self) -> Grammar | None:
        """The grammar the output must match (None: free text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":  # any JSON object
            return Grammar(GrammarKind.JSON_SCHEMA, '{"type": "object"}')
        if self.type == "json_schema":
            if self.json_schema is None:
                raise InvalidRequest('response_format "json_schema" needs its json_schema object',
                                     param="response_format")
            schema = {} if self.json_schema.json_schema is None else self.json_schema.json_schema  # {}: any JSON
            return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))
        if self.type in ("regex", "grammar"):
            spec = self.regex if self.type == "regex" else self.grammar
            if not spec:
                raise InvalidRequest(f'response_format "{self.type}" needs its {self.type} string',
                                     param="response_format")
            return Grammar(GrammarKind.REGEX if self.type == "regex" else GrammarKind.EBNF, spec)
        raise InvalidRequest(
            f"response_format type {self.type!r} is not one of text, json_object, json_schema, regex, grammar",
            param="response_format",
        )
