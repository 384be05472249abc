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

import os
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Share of the memory free after the model loaded that the KV caches may take by default.
AUTO_BUDGET_FRACTION = 0.5
SPARE_POSITIONS = 256  # room a layer that runs out grows by, past what it needs


class GrowableLayer(DynamicLayer):
    """A ``DynamicLayer`` that writes new keys and values in place instead of concatenating.

    transformers' dynamic layer makes a new tensor of the whole history at every update
    (``torch.cat``), so a decode step copies every session's whole cache once per layer, and
    again for every session of a batched pass. This layer keeps a buffer with ``SPARE_POSITIONS``
    of room and hands out views of its filled part: an update writes only its new positions (the
    buffer is copied once per ``SPARE_POSITIONS`` positions), a rollback (``crop``) only moves the
    end. ``keys``/``values`` stay the views transformers and the engine read, ``[batch, kv_heads,
    length, head_dim]`` (figures: docs/target.md#sliding-window-and-the-kv-cache). The spare
    room (``SPARE_POSITIONS``) is memory past a session's KV reservation.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = self._value_buffer = None
        self._length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        end = self._length + new
        if self._key_buffer is None or end > self._key_buffer.shape[-2]:
            self._grow(key_states, value_states, end + SPARE_POSITIONS)
        self._key_buffer[..., self._length : end, :] = key_states
        self._value_buffer[..., self._length : end, :] = value_states
        self._set_length(end)
        return self.keys, self.values

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys, values) [batch, kv_heads, capacity, head_dim], the held positions first; None before
        the first update."""
        return None if getattr(self, "_key_buffer", None) is None else (self._key_buffer, self._value_buffer)

    def reserve(self, new: int) -> int:
        """Room for ``new`` more positions in the buffers (grown as :meth:`update` grows them); returns
        the positions held. For a writer that fills ``[held, held + new)`` of the buffers itself and
        then calls :meth:`advance` (the native decoder layer); the layer must have been updated once."""
        if self._key_buffer is None:
            raise RuntimeError("reserve before the layer's first update")
        end = self._length + new
        if end > self._key_buffer.shape[-2]:
            self._grow(self._key_buffer[..., :0, :], self._value_buffer[..., :0, :], end + SPARE_POSITIONS)
        return self._length

    def advance(self, new: int) -> None:
        """Counts ``new`` positions written after :meth:`reserve` as held."""
        self._set_length(self._length + new)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self._set_length(max(0, self._length + tokens_to_remove))

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        def buffer(old: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
            # [batch, kv_heads, capacity, head_dim]
            fresh = like.new_empty((*like.shape[:-2], capacity, like.shape[-1]))
            if old is not None:
                fresh[..., : self._length, :] = old[..., : self._length, :]
            return fresh

        self._key_buffer = buffer(self._key_buffer, key_states)
        self._value_buffer = buffer(self._value_buffer, value_states)

    def _set_length(self, length: int) -> None:
        self._length = length
        self.keys = self._key_buffer[..., :length, :]
        self.values = self._value_buffer[..., :length, :]


def new_cache() -> DynamicCache:
    """An empty cache whose layers all keep full history (see the module docstring), written in
    place (:class:`GrowableLayer`)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowableLayer
    return cache


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


def bytes_per_position(text_config, dtype: torch.dtype) -> int:
    """Bytes one position takes in a session's cache: keys and values of every layer (all layers
    keep full history here, sliding-window ones included)."""
    layers = int(text_config.num_hidden_layers)
    heads = int(getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return layers * 2 * heads * int(head_dim) * torch.empty((), dtype=dtype).element_size()


def free_memory_bytes(device: str) -> int:
    """Memory free now on the device: CUDA's free memory, or the host's MemAvailable, capped by
    the container's cgroup limit (inside a container /proc/meminfo shows the whole host)."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as meminfo:
            free = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return free
    return free if limit == "max" else min(free, max(0, int(limit) - used))


def copy_prefix(cache: DynamicCache, length: int) -> DynamicCache:
    """A new cache holding a copy of the first ``length`` positions of ``cache`` (which is left as it is)."""
    held = cache_length(cache)
    if not 0 <= length <= held:
        raise ValueError(f"cannot copy {length} positions of a KV cache of {held}")
    copy = new_cache()
    if length:
        for index, layer in enumerate(cache.layers):
            copy.update(layer.keys[..., :length, :], layer.values[..., :length, :], index)
    return copy


def capacity(cache: DynamicCache) -> int:
    """Positions the cache's buffers have room for (what it takes of memory, in positions)."""
    layer = cache.layers[0] if cache.layers else None
    buffer = getattr(layer, "_key_buffer", None)
    return cache_length(cache) if buffer is None else int(buffer.shape[-2])
