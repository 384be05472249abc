"""A session's KV cache and its rollback to the accepted prefix.

A verify pass writes the keys/values of every draft token; after the verdict the cache must hold
exactly the committed prefix again, so the rejected tail is cut off.

The cache is a transformers ``DynamicCache`` built *without* the model config. With the config,
transformers gives sliding-window layers (Gemma 3: 512 tokens on five of every six layers) a
cache that keeps only the last window of keys; cutting tokens off such a cache cannot bring back
the older keys that slid out, so after a rollback those layers would attend to too little. Built
without the config, every layer keeps the full history and rollback is a plain slice; the
attention masks still apply each layer's window (they come from the model config, not from the
cache), so the model computes exactly what it computes with the windowed cache. The price is
memory: sliding layers keep keys outside their window.
"""

from __future__ import annotations

from transformers import DynamicCache


def new_cache() -> DynamicCache:
    """An empty cache whose layers all keep full history (see the module docstring)."""
    return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    """Number of positions held."""
    return cache.get_seq_length()


def truncate(cache: DynamicCache, length: int) -> None:
    """Keeps the first ``length`` positions and drops the rest.

    transformers 5 ``crop(-n)`` removes the last n positions (a positive argument raises).
    """
    held = cache_length(cache)
    if not 0 <= length <= held:
        raise ValueError(f"cannot truncate a KV cache of {held} positions to {length}")
    if length < held:
        cache.crop(length - held)
