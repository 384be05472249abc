"""What the gateway knows about the model it serves: name, tokenizer and context length."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.chat_template import ChatFormat
from gateway.token_strings import TokenStrings
from tandem.models import resolve, tokenizer_fingerprint


@dataclass
class ServedModel:
    name: str
    tokenizer: Any
    # Tokens per sequence, prompt included. Starts from the checkpoint's config and is replaced
    # by the target's own limit (TargetService.Info.max_context_len) once the target answers,
    # since the target may be configured below the model's limit.
    max_context_len: int
    # tandem.models.tokenizer_fingerprint of the tokenizer: computed where not given (a start reads
    # it from the record tandem.models.tokenizer_facts keeps for the checkpoint's tokenizer files).
    fingerprint: str = ""
    # A chat template given at start-up (--chat-template) in place of the tokenizer's; None: its own.
    chat_template: str | None = None
    chat: ChatFormat = field(init=False)
    # Token ids the tokenizer can decode: valid ids are 0 <= id < vocab_size. Counted once: a
    # tokenizer's len() walks its added tokens (~0.4-1 ms), and every request's validation asks.
    vocab_size: int = field(init=False)
    # Tokens as text and bytes, for the log-probabilities a response shows.
    strings: TokenStrings = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.fingerprint = self.fingerprint or tokenizer_fingerprint(self.tokenizer)
        self.chat = ChatFormat.for_tokenizer(self.tokenizer, self.chat_template)
        self.vocab_size = len(self.tokenizer)
        self.strings = TokenStrings(self.tokenizer)


def config_context_len(spec: str) -> int:
    """The checkpoint's context length (``max_position_embeddings`` of its text config)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(resolve(spec).hf_dir)).get_text_config()
    return int(config.max_position_embeddings)
