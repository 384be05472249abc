"""One quick parse of a GGUF file for its conversion to a Hugging Face checkpoint.

transformers converts a GGUF through gguf-py's ``GGUFReader`` and opens the file once for the
tokenizer, once for the config and once for the weights, each time parsing every metadata field
and turning each element of each array field into Python values. For gemma-3-270m's
262,144-token vocabulary (tokens, scores, token types: ~790,000 elements) that made a conversion,
a user's first start on a GGUF file, take most of a minute. Within :func:`one_gguf_parse`:

- opening a file again gives the reader already made (a reader only maps the file read-only);
- the reader takes its field and tensor views from a plain ``ndarray`` over its memory map: the
  same bytes, but slicing skips ``np.memmap``'s Python-level ``__getitem__`` and
  ``__array_finalize__``, which cost about two thirds of a parse;
- transformers' metadata-only reading of a file (``load_gguf_checkpoint(path,
  return_tensors=False)``, the tokenizer's and the config's) is made once and handed out as copies;
- gguf-py's table of tensor names (``get_tensor_name_map``), which transformers builds again for
  every module of the model while it maps the file's tensors to the model's (gemma-3-270m has 313),
  is built once per architecture and depth.

Invariant: what transformers reads is unchanged (the same fields, parts and tensors, byte for
byte), so the converted checkpoint is the same as without it; tests compare the two.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@functools.cache
def plain_view_reader() -> type:
    """gguf-py's reader class, its views taken from a plain ndarray (the class made once); gguf-py's
    own where its reader is not built on the ``_get`` this overrides."""
    import numpy as np
    from gguf.gguf_reader import GGUFReader

    if list(inspect.signature(GGUFReader._get).parameters) != ["self", "offset", "dtype", "count", "override_order"]:
        log.info("this gguf-py's reader is built another way: GGUF files are parsed as it parses them")
        return GGUFReader

    class PlainViewReader(GGUFReader):
        """``GGUFReader`` whose views come from a plain ndarray over the same memory map."""

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> Any:
            plain = self.__dict__.get("_plain")
            if plain is None:  # self.data is the np.memmap the reader's __init__ has just made
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            size = np.dtype(dtype).itemsize * count
            array = plain[offset : offset + size].view(dtype=dtype)[:count]
            return array.view(array.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return PlainViewReader


def read_gguf(path: str | Path) -> Any:
    """A reader of the GGUF file at ``path``: within :func:`one_gguf_parse` the one it shares,
    else a new :func:`plain_view_reader` (a target repacking a file's blocks at its start)."""
    import gguf
    from gguf.gguf_reader import GGUFReader

    if gguf.GGUFReader is not GGUFReader:  # one_gguf_parse's (or a test's) stands in for it
        return gguf.GGUFReader(str(path))
    return plain_view_reader()(str(path))


@contextmanager
def one_gguf_parse() -> Iterator[None]:
    """Within it, transformers parses each GGUF file once, quickly (see the module's docstring).

    Used only by a conversion, which holds the conversion's lock; it patches module attributes of
    gguf-py and transformers for its duration."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    real_reader, real_load, real_name_map = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map
    reader_type = plain_view_reader()
    readers: dict[tuple[str, str], Any] = {}
    metadata: dict[str, dict] = {}

    def shared_reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader_type(path, mode)
        return readers[key]

    def load_once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return real_load(path, return_tensors, *args, **kwargs)
        key = str(Path(path).resolve())
        if key not in metadata:
            metadata[key] = real_load(path, False)
        return copy.deepcopy(metadata[key])  # callers may change what they are given

    # (transformers only looks names up in the table, so one table serves every module)
    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = shared_reader, load_once
    gguf.get_tensor_name_map = functools.cache(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map = real_reader, real_load, real_name_map
