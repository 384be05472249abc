"""What clients send that tandem does not do, refused by name with a 400 instead of dropped.

A client that asks for audio, a web search, legacy ``functions``, an image in a message or another
server's sampling control (``tfs_z``, llama.cpp's ``repeat_penalty``, ...) and gets plain
text back has lost what it asked for without being told. So each of these is refused, naming the
field and what to send instead. Fields that only describe the caller or hint at effort (``user``,
``metadata``, ``store``, ``service_tier``, ``reasoning_effort``, ``verbosity``, ...) change nothing
a client could check in the answer; they stay ignored, as OpenAI-compatible servers ignore unknown
fields. A refused field sent with its neutral value (null, ``tfs_z: 1``, ``modalities: ["text"]``,
``use_beam_search: false``) asks for nothing and passes: clients that always send a full set of
defaults keep working.

Invariant: a request that passes :func:`refuse_unsupported` asks for nothing tandem leaves out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gateway.errors import InvalidRequest

Neutral = Callable[[Any], bool]


def _equal_to(*values: object) -> Neutral:
    """Neutral when null or equal to one of ``values`` (a boolean only to a boolean: True is not 1)."""
    return lambda v: v is None or any(v == x and isinstance(v, bool) == isinstance(x, bool) for x in values)


def _empty(value: Any) -> bool:
    return value is None or value in ([], {}, "")


def _text_only(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(m == "text" for m in value))


# Read on the chat and completions routes (gateway.structured_fields); refused on /v1/responses.
_CHAT_ONLY = "it shapes how messages are rendered; /v1/chat/completions takes it"
_TEXT_ROUTES = "/v1/chat/completions and /v1/completions take it"
_STRUCTURED = "on /v1/responses use text.format (json_schema, regex or grammar; see docs/structured-output.md)"
_SAMPLING = ("this server samples with temperature, top_p, top_k, min_p, typical_p, logit_bias, bad_words, "
             "allowed_token_ids and the presence, frequency and repetition penalties only")

# field: (is its value neutral, what to tell the client)
REFUSED: dict[str, tuple[Neutral, str]] = {
    # OpenAI's own
    "functions": (_empty, "legacy function calling is not supported; send tools (and tool_choice) instead"),
    "function_call": (_equal_to("none"), "legacy function calling is not supported; send tool_choice instead"),
    "audio": (_empty, "audio output is not supported: this server answers in text"),
    "modalities": (_text_only, 'only the "text" modality is served'),
    "web_search_options": (lambda v: v is None, "web search is not available on this server"),
    # other servers' sampling controls
    "tfs_z": (_equal_to(1), _SAMPLING),
    "top_a": (_equal_to(0), _SAMPLING),
    "repeat_penalty": (_equal_to(1), "llama.cpp's repeat_penalty looks at the last tokens only; send "
                                     "repetition_penalty, which penalises repeats of the whole text"),
    "mirostat": (_equal_to(0), _SAMPLING),
    "mirostat_mode": (_equal_to(0), _SAMPLING),
    "dry_multiplier": (_equal_to(0), _SAMPLING),
    "xtc_probability": (_equal_to(0), _SAMPLING),
    "use_beam_search": (_equal_to(False), "beam search is not supported"),
    "prompt_logprobs": (lambda v: v is None, "prompt_logprobs is not supported; completions with echo and "
                                             "logprobs score the prompt's tokens"),
    "return_tokens_as_token_ids": (_equal_to(False), "log-probabilities name their tokens by text; /tokenize gives "
                                                     "the ids"),
    # read on the chat and completions routes (gateway.protocol); refused where not read
    "skip_special_tokens": (_equal_to(True), _TEXT_ROUTES),
    # other servers' ways to ask for structured output, and their chat-template controls
    "guided_json": (lambda v: v is None, _STRUCTURED),
    "guided_regex": (lambda v: v is None, _STRUCTURED),
    "guided_choice": (lambda v: v is None, _STRUCTURED),
    "guided_grammar": (lambda v: v is None, _STRUCTURED),
    "structured_outputs": (lambda v: v is None, _STRUCTURED),
    "json_schema": (lambda v: v is None, _STRUCTURED),
    "grammar": (lambda v: v is None, _STRUCTURED),
    "chat_template": (lambda v: v is None, "chat_template is not supported: the model's own template is used"),
    # chat template controls: /v1/chat/completions takes them (gateway.chat_template.TemplateOptions)
    "continue_final_message": (_equal_to(False), _CHAT_ONLY),
    "add_generation_prompt": (_equal_to(True), _CHAT_ONLY),
    "chat_template_kwargs": (_empty, _CHAT_ONLY),
}


def refuse_unsupported(extra: Mapping[str, Any] | None) -> None:
    """Raises :class:`InvalidRequest` for the first field of ``extra`` (the body's fields no route
    declares) that asks for something tandem does not do."""
    for name, value in (extra or {}).items():
        rule = REFUSED.get(name)
        if rule is not None and not rule[0](value):
            raise InvalidRequest(f"{name} is not supported by this server: {rule[1]}", param=name)


def text_of_parts(parts: Sequence[Any], where: str, text_fields: Mapping[str, str]) -> str:
    """The text of a message's content parts, joined. ``text_fields``: each part type read as text
    and the field its text is in (``{"text": "text"}``); a part of any other type is refused by
    name (:func:`refuse_part`), one without its text too."""
    texts = []
    for j, part in enumerate(parts):
        field = text_fields.get(part.type)
        if field is None:
            raise refuse_part(part.type, f"{where}.content[{j}]")
        text = getattr(part, field)
        if text is None:
            raise InvalidRequest(f"{where}.content[{j}]: a {part.type} part needs its {field}",
                                 param=f"{where}.content[{j}].{field}")
        texts.append(text)
    return "".join(texts)


def refuse_part(kind: str, where: str) -> InvalidRequest:
    """The error for a message content part tandem cannot read (an image, audio, a file)."""
    return InvalidRequest(f"{where}: content parts of type {kind!r} are not supported: this server's model reads "
                          "text only; send text parts", param=where)


def refuse_tool(kind: str, where: str) -> InvalidRequest:
    """The error for a built-in tool (web search, file search, ...) in place of a function tool."""
    return InvalidRequest(f"{where}: tools of type {kind!r} are not supported: this server calls function tools "
                          "(type \"function\") only", param=where)
