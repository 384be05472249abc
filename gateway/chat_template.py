"""Turning chat messages into prompt tokens, with a plain fallback for models without a template.

A tokenizer that ships a chat template (``tokenizer.chat_template``) is rendered with it, as
transformers and vLLM do. A base model such as the default ``gemma-3-270m`` has none, so the
gateway uses this documented **fallback template**: a plain transcript, one paragraph per message,
each introduced by its capitalised role, ending with an open ``Assistant:`` turn::

    <bos>System: You are terse.

    User: Say hello.

    Assistant:

A base model continues such a transcript naturally, and would go on to write the next
``User:`` turn itself; so the fallback also contributes the stop string ``"\\nUser:"``, which ends
the assistant's turn there (the stop string is not part of the returned text).

A template given at start-up (``--chat-template``, a file or the template itself, as vLLM and
llama.cpp take one) replaces the tokenizer's own or the fallback: for a base model one would
rather prompt another way, or a checkpoint whose template is missing or wrong.

A chat request can shape the rendering as vLLM's and llama.cpp's chat APIs let it
(:class:`gateway.template_options.TemplateOptions`): ``add_generation_prompt`` false leaves the
assistant turn unopened, ``continue_final_message`` leaves the last (assistant) message open so the
answer continues it (transformers cuts the rendering after that message's text), and
``chat_template_kwargs`` sets the template's own variables (Qwen 3's ``enable_thinking``, say). A
template reads only the variables it names, so kwargs a template ignores change nothing, as in vLLM.

Independently of the template, when the vocabulary has an end-of-turn token (Gemma's
``<end_of_turn>``, Llama 3's ``<|eot_id|>``, ChatML's ``<|im_end|>``, Phi's ``<|end|>``), chat
requests stop on it too: instruction-tuned models end their answer with it rather than with EOS.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from gateway.template_options import TemplateOptions

FALLBACK_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
FALLBACK_STOP_STRINGS = ("\nUser:",)
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>")
# Variables the gateway itself gives every template, besides apply_chat_template's own arguments.
TEMPLATE_NAMES = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "bos_token", "eos_token", "unk_token", "pad_token",
})


@dataclass(frozen=True)
class ToolCallMade:
    """A call an assistant message made (the history of a tool-calling conversation)."""

    id: str
    name: str
    arguments: Any  # the arguments, parsed from their JSON


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCallMade, ...] = ()  # an assistant message's calls (gateway.tools)
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (e.g. the model's template rejects their order)."""


@dataclass(frozen=True)
class ChatFormat:
    """How one tokenizer turns a conversation into prompt token ids."""

    tokenizer: Any
    # None means the tokenizer's own template.
    template: str | None
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    # what chat_template_kwargs may not set: the render call's own arguments, the messages and tools,
    # and the special tokens transformers hands the template (a request would otherwise override them)
    reserved_names: frozenset[str] = frozenset()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, template: str | None = None) -> ChatFormat:
        """The tokenizer's own template, else the fallback; ``template`` (given at start-up) in place
        of either."""
        own = template is not None or bool(getattr(tokenizer, "chat_template", None))
        return cls(
            tokenizer=tokenizer,
            template=template if template is not None else None if own else FALLBACK_TEMPLATE,
            stop_strings=() if own else FALLBACK_STOP_STRINGS,
            stop_token_ids=end_of_turn_ids(tokenizer),
            reserved_names=_reserved_names(tokenizer),
        )

    @property
    def uses_fallback(self) -> bool:
        return self.template == FALLBACK_TEMPLATE

    def render(self, messages: Sequence[ChatMessage], options: TemplateOptions = TemplateOptions()) -> str:
        """The prompt text, ending with an open assistant turn (unless ``options`` says otherwise:
        then as the last message ends, or inside it); it carries its own BOS."""
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                conversation, chat_template=self.template, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, tokenize=False, **options.kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template cannot render these messages: {exc}") from exc
        except (TypeError, ValueError) as exc:  # transformers' own checks (continue_final_message's message)
            raise ChatTemplateError(f"the messages cannot be rendered: {exc}") from exc

    def token_ids(self, messages: Sequence[ChatMessage], options: TemplateOptions = TemplateOptions()) -> list[int]:
        # The rendered text already holds BOS (templates write it), so add no special tokens.
        return self.tokenizer(self.render(messages, options), add_special_tokens=False)["input_ids"]


def _reserved_names(tokenizer: Any) -> frozenset[str]:
    try:
        arguments = set(inspect.signature(tokenizer.apply_chat_template).parameters)
    except (TypeError, ValueError):  # no signature to read: the arguments transformers 5 takes
        arguments = set()
    special = set(getattr(tokenizer, "special_tokens_map", {}) or {})
    return frozenset((arguments | special | TEMPLATE_NAMES) - {"kwargs"})


def load_template(value: str) -> str:
    """``--chat-template``'s template: the file ``value`` names, or ``value`` itself where it is a
    Jinja template (it holds ``{{`` or ``{%``); ValueError otherwise."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"{value!r} is neither a file nor a Jinja template")


def end_of_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    """Ids of the known end-of-turn tokens that this vocabulary has as single tokens (looked up one
    by one where the tokenizer has a ``tokenizers`` backend: its whole vocabulary as a dict is a
    quarter of a second at 262k ids, on every start)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        found = (backend.token_to_id(token) for token in END_OF_TURN_TOKENS)
        return tuple(i for i in found if i is not None)
    vocab = tokenizer.get_vocab()
    return tuple(vocab[token] for token in END_OF_TURN_TOKENS if token in vocab)
