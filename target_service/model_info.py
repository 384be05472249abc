"""What the engine reads off the target model's config and tokenizer: its limits and its identity.

Kept apart from the engine because none of it touches a session or a forward pass: these are the
facts ``Info`` reports and every request is checked against. Invariant: each value is the
strictest the model and the settings allow together (the context is the smaller of the two
limits; EOS is every end-of-sequence id any source names), and a caller whose tokenizer differs
from the target's is refused before it can reach a session.
"""

from __future__ import annotations

from tandem.models import LoadedModel
from tandem.models.tokenizer_facts import TokenizerFacts
from target_service.types import EngineInfo
from target_service.errors import TokenizerMismatch


def engine_info(loaded: LoadedModel, tokenizer: TokenizerFacts, max_context_len: int,
                verifier_backend: str) -> EngineInfo:
    """The target's description for ``Info`` (``max_context_len``: the configured limit, 0 = none)."""
    text_config = loaded.model.config.get_text_config()
    vocab_size = int(text_config.vocab_size)
    return EngineInfo(
        model_name=loaded.name,
        vocab_size=vocab_size,
        tokenizer_fingerprint=tokenizer.fingerprint,
        dtype=loaded.weights,
        device=loaded.device,
        max_context_len=context_len(text_config, max_context_len),
        eos_token_ids=eos_token_ids(loaded, tokenizer.eos_token_id, vocab_size),
        hidden_size=int(text_config.hidden_size),
        verifier_backend=verifier_backend,
    )


def check_tokenizer(info: EngineInfo, fingerprint: str) -> None:
    """Refuses a caller whose (non-empty) tokenizer fingerprint differs from the target's."""
    ours = info.tokenizer_fingerprint
    if fingerprint and fingerprint != ours:
        raise TokenizerMismatch(
            f"tokenizer mismatch: the target model {info.model_name!r} has tokenizer fingerprint {ours}, "
            f"the caller's tokenizer has {fingerprint}; draft and target must share a tokenizer"
        )


def sliding_window(text_config) -> int | None:
    """The window of the model's sliding-attention layers, or None when it has none."""
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None) or ()
    if not window or "sliding_attention" not in layer_types:
        return None
    return int(window)


def context_len(text_config, configured: int) -> int:
    """Tokens per session: the configured limit, capped by the model's position embeddings."""
    model_limit = int(getattr(text_config, "max_position_embeddings", 0) or 0)
    limits = [limit for limit in (configured, model_limit) if limit > 0]
    if not limits:
        raise ValueError("the model config names no max_position_embeddings; set max_context_len")
    return min(limits)


def eos_token_ids(loaded: LoadedModel, tokenizer_eos: int | None, vocab_size: int) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer's."""
    found: set[int] = set()
    sources = (getattr(loaded.model, "generation_config", None), loaded.model.config)
    for value in [getattr(source, "eos_token_id", None) for source in sources] + [tokenizer_eos]:
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(token, int) and 0 <= token < vocab_size:
                found.add(token)
    return tuple(sorted(found))
