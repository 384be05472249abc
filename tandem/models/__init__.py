"""Models shared by the target and the draft: SPECs and the GGUF conversion cache (``specs``),
loading for inference (``loading``), the feature-conditioned draft head (``eagle``) and a service's
one model thread (``worker``).

The SPEC and loading API is re-exported here (``from tandem.models import load_model``); tests that
replace a function patch it in the module that defines it.
"""

from tandem.models.loading import (
    LoadedModel,
    load_model,
    load_tokenizer,
    pick_device,
    pick_dtype,
    tokenizer_fingerprint,
)
from tandem.models.specs import (
    AUTO_DRAFT,
    BUILTIN_HEADS_DIR,
    BUILTIN_MODELS,
    DEFAULT_TARGET,
    DRAFT_NAMES,
    EAGLE_CONFIG_FILE,
    EAGLE_DRAFT,
    MODEL_FREE_DRAFTS,
    NGRAM_FIRST_PREFIX,
    ModelSpecError,
    ResolvedSpec,
    cache_dir,
    default_served_name,
    is_eagle_draft,
    is_model_free_draft,
    needs_conversion,
    ngram_first_head,
    resolve,
    resolve_draft_spec,
)

__all__ = [
    "AUTO_DRAFT", "BUILTIN_HEADS_DIR", "BUILTIN_MODELS", "DEFAULT_TARGET", "DRAFT_NAMES", "EAGLE_CONFIG_FILE",
    "EAGLE_DRAFT", "MODEL_FREE_DRAFTS", "NGRAM_FIRST_PREFIX", "LoadedModel", "ModelSpecError", "ResolvedSpec",
    "cache_dir", "default_served_name", "is_eagle_draft", "is_model_free_draft", "load_model", "load_tokenizer",
    "needs_conversion", "ngram_first_head", "pick_device", "pick_dtype", "resolve", "resolve_draft_spec", "tokenizer_fingerprint",
]
