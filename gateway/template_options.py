"""A chat request's template controls, as vLLM's and llama.cpp's chat APIs take them.

``add_generation_prompt`` false leaves the assistant turn unopened; ``continue_final_message``
leaves the last message, the assistant's, open, so the answer continues it (clients use it to
resume a cut-off answer or to put words in the model's mouth); ``chat_template_kwargs`` sets the
template's own variables (Qwen 3's ``enable_thinking``). :mod:`gateway.chat_template` renders with
them. Invariant: options that pass :meth:`TemplateOptions.check` render, or fail with the template's
own complaint; none overrides what the server gives the template (messages, tools, special tokens).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import InvalidRequest

MAX_KWARGS_BYTES = 65536  # chat_template_kwargs as JSON: variables for a template, not a document store


@dataclass(frozen=True)
class TemplateOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # the template's own variables (JSON values)

    def check(self, messages: Sequence[Any], reserved: Collection[str]) -> None:
        """Raises :class:`InvalidRequest` where these options cannot render ``messages`` (chat
        messages with a ``role``): ``reserved`` are the names the server sets itself."""
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequest("continue_final_message needs add_generation_prompt: false (the answer "
                                     "continues the last message instead of opening a turn)",
                                     param="continue_final_message")
            if messages[-1].role != "assistant":
                raise InvalidRequest(f"continue_final_message continues the assistant's last message; the last "
                                     f"message is the {messages[-1].role}'s", param="continue_final_message")
        taken = sorted(set(self.kwargs) & set(reserved))
        if taken:
            raise InvalidRequest(f"chat_template_kwargs cannot set {', '.join(map(repr, taken))}: the server "
                                 "sets them (send the fields of the request instead)", param="chat_template_kwargs")
        size = len(json.dumps(self.kwargs))
        if size > MAX_KWARGS_BYTES:
            raise InvalidRequest(f"chat_template_kwargs takes {size} bytes as JSON, at most {MAX_KWARGS_BYTES}",
                                 param="chat_template_kwargs")
