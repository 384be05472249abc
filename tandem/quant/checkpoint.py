"""A loaded model's linear layers and embedding computed on its GGUF file's own blocks.

``quantize_model`` takes a model loaded from the float32 conversion of a GGUF file (what
``tandem.models`` caches) and the file itself, and swaps every ``nn.Linear`` / ``nn.Embedding``
whose GGUF tensor is in a block type tandem reads (``tandem.quant.gguf_blocks``) for a
:class:`~tandem.quant.modules.QuantLinear` / :class:`~tandem.quant.modules.QuantEmbedding`. GGUF
and transformers names are matched with gguf-py's tensor name map; a tied LM head shares the
embedding's blocks.

Invariant: a module is swapped only where the blocks dequantize to the module's float32 weight
exactly, compared in full when the blocks are first repacked and on sampled rows when they come
from the cache. So the quantized model is the float32 checkpoint, read at its file's bit widths;
a tensor that differs (a conversion that transformed it, an unread block type) keeps its float32
weight, and the summary says which.

The repacked blocks are cached beside the float32 conversion (``BLOCKS_FILE``, safetensors) with
the file's architecture (all the name map needs from it), so only the first start reads the GGUF
file: gguf-py parses every metadata field when it opens one, a 262,144-token vocabulary included
(seconds even read as ``tandem.models.gguf_parse.read_gguf`` reads it). The conversion itself
writes the cache from the reader it already holds (:func:`write_blocks`), marked unchecked; the
first load compares it in full, as it would blocks it had repacked itself, and marks it checked.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tandem.quant import gguf_blocks
from tandem.quant.modules import QuantEmbedding, QuantLinear
from tandem.quant.native import QuantKernel
from tandem.quant.reference import dequantize
from tandem.quant.tensor import LAYOUT_VERSION, QuantizedTensor

log = logging.getLogger(__name__)

BLOCKS_FILE = "gguf-blocks.safetensors"
CHECK_ROWS = 4096  # rows compared at a time in the full check (bounds its memory)
SAMPLED_ROWS = 16  # rows per tensor compared when the blocks come from the cache


@dataclass
class QuantSummary:
    """What ``quantize_model`` did: modules swapped by block type, and those left in float32 (why)."""

    by_type: dict[str, int] = field(default_factory=dict)  # GGUF block type -> modules computing on it
    kept_float: dict[str, str] = field(default_factory=dict)  # module name -> reason
    weight_bytes: int = 0  # bytes of quantized weights a pass reads (a tied head counted once)
    kernel: str = ""

    @property
    def swapped(self) -> int:
        return sum(self.by_type.values())

    def describe(self) -> str:
        types = ", ".join(f"{n} {t}" for t, n in sorted(self.by_type.items()))
        kept = f"; {len(self.kept_float)} kept float32" if self.kept_float else ""
        return f"{self.swapped} modules on GGUF blocks ({types}; {self.weight_bytes / 2**20:.0f} MB){kept}, kernel {self.kernel}"

    @property
    def dtype(self) -> str:
        """What Info reports as the target's dtype: ``quantized:`` and the block types."""
        return "quantized:" + ",".join(sorted(self.by_type))


def quantize_model(model: nn.Module, gguf_path: Path, blocks_file: Path, kernel: QuantKernel) -> QuantSummary:
    """Swaps the model's linear layers and embedding for quantized ones where the GGUF file's blocks
    are exactly their weights (see the module docstring); returns what it did."""
    blocks, architecture, fresh = _blocks(gguf_path, blocks_file)
    names = _gguf_names(model, architecture)
    summary = QuantSummary(kernel=kernel.isa)
    counted: set[str] = set()
    prepared: dict[str, QuantizedTensor] = {}  # GGUF name -> in the kernel's layout (a tied head and embedding share it)
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False)) if config is not None else False
    for name, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        key = names.get(name)
        if key is not None and key not in blocks and key == "output.weight" and tied:
            key = "token_embd.weight"  # a tied LM head: the embedding's blocks
        weight = blocks.get(key) if key else None
        if weight is None:
            summary.kept_float[name] = "no quantized GGUF tensor" if key else "no GGUF name"
            continue
        if weight.shape != tuple(module.weight.shape):
            summary.kept_float[name] = f"GGUF shape {weight.shape} != {tuple(module.weight.shape)}"
            continue
        if not _equal(weight, module.weight.detach().float(), full=fresh):
            summary.kept_float[name] = f"its {weight.source} blocks differ from the converted weight"
            continue
        if key not in prepared:
            prepared[key] = kernel.prepare(weight)
        _replace(model, name, _swap(module, prepared[key], kernel))
        summary.by_type[weight.source] = summary.by_type.get(weight.source, 0) + 1
        if key not in counted:
            counted.add(key)
            summary.weight_bytes += weight.nbytes
    for name, reason in summary.kept_float.items():
        log.info("%s keeps its float32 weight: %s", name, reason)
    return summary


def _swap(module: nn.Module, weight: QuantizedTensor, kernel: QuantKernel) -> nn.Module:
    if isinstance(module, nn.Linear):
        return QuantLinear(weight, module.bias, kernel)
    scale = getattr(module, "embed_scale", 1.0)  # Gemma's scaled embedding
    return QuantEmbedding(weight, scale.detach() if isinstance(scale, torch.Tensor) else scale, module.padding_idx)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _equal(weight: QuantizedTensor, dense: torch.Tensor, full: bool) -> bool:
    """Whether ``weight`` dequantizes to ``dense`` [out, in] exactly: every row (``full``), or a sample."""
    out = weight.shape[0]
    if full:
        spans = [torch.arange(start, min(start + CHECK_ROWS, out)) for start in range(0, out, CHECK_ROWS)]
    else:
        spans = [torch.randperm(out, generator=torch.Generator().manual_seed(out))[:SAMPLED_ROWS].sort().values]
    return all(torch.equal(dequantize(weight.rows(rows)), dense.index_select(0, rows)) for rows in spans)


def _gguf_names(model: nn.Module, arch_name: str) -> dict[str, str]:
    """transformers module name -> GGUF tensor name (``blk.0.attn_q.weight``), by gguf-py's map for
    the file's architecture (``general.architecture``, e.g. ``gemma3``)."""
    import gguf

    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        return {}
    layers = int(getattr(model.config.get_text_config(), "num_hidden_layers", 0))
    name_map = gguf.get_tensor_name_map(arch, layers)
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            found = name_map.get_name(name)
            if found is not None:
                names[name] = found + ".weight"
    return names


EMBEDDING = "token_embd.weight"  # the token embedding's GGUF name


def cached_embedding(checkpoint: Path, dense: torch.Tensor) -> QuantizedTensor | None:
    """The GGUF blocks of a converted checkpoint's token embedding, from its ``BLOCKS_FILE`` (only
    that tensor is read), where they dequantize exactly to ``dense`` [vocab, hidden] (the converted
    float weight) on a sample of rows; None where the checkpoint has none (not a GGUF conversion) or
    they differ. The same values in about a quarter of float32's bytes: an eagle draft looks its
    token rows up from them (``tandem.models.eagle``)."""
    from safetensors import safe_open

    blocks_file = Path(checkpoint) / BLOCKS_FILE
    if not blocks_file.is_file():
        return None
    try:
        with safe_open(str(blocks_file), framework="pt") as f:
            spec = json.loads((f.metadata() or {}).get("tensors", "{}")).get(EMBEDDING)
            if spec is None:
                return None
            weight = QuantizedTensor(
                f.get_tensor(f"{EMBEDDING}/packed"), f.get_tensor(f"{EMBEDDING}/scale"),
                f.get_tensor(f"{EMBEDDING}/mins") if spec["mins"] else None,
                spec["group"], spec["bits"], spec["zero"], spec["source"],
            )
    except Exception as error:  # noqa: BLE001  a damaged cache: the float weight serves
        log.warning("ignoring the embedding's blocks in %s: %s", blocks_file, error)
        return None
    if weight.shape != tuple(dense.shape) or not _equal(weight, dense, full=False):
        log.info("the embedding's blocks in %s are not the checkpoint's embedding; keeping its float weight",
                 blocks_file)
        return None
    return weight


def write_blocks(gguf_path: Path, blocks_file: Path) -> None:
    """Repacks the GGUF file's quantized tensors into ``blocks_file``, marked unchecked (the first
    :func:`quantize_model` compares them in full). For the conversion, which has the file parsed
    already (``tandem.models.specs``): the first start then reads it once, not twice."""
    blocks, architecture = _repack(gguf_path)
    _write_cache(blocks_file, blocks, architecture, _source_id(gguf_path), checked=False)


def _blocks(gguf_path: Path, blocks_file: Path) -> tuple[dict[str, QuantizedTensor], str, bool]:
    """The GGUF file's quantized tensors and architecture, from the cache or read now (then cached);
    and whether they are compared in full now (read now, or cached unchecked by the conversion)."""
    source = _source_id(gguf_path)
    cached = _read_cache(blocks_file, source)
    if cached is not None and cached[2]:
        return cached[0], cached[1], False
    blocks_file.parent.mkdir(parents=True, exist_ok=True)
    with open(blocks_file.with_name(blocks_file.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the target and a draft may start together
        cached = _read_cache(blocks_file, source)
        if cached is not None:
            blocks, architecture, checked = cached
            if not checked:
                _write_cache(blocks_file, blocks, architecture, source)  # compared in full by the caller now
            return blocks, architecture, not checked
        log.info("repacking the quantized tensors of %s (first start only)", gguf_path)
        blocks, architecture = _repack(gguf_path)
        _write_cache(blocks_file, blocks, architecture, source)
        return blocks, architecture, True


def _repack(gguf_path: Path) -> tuple[dict[str, QuantizedTensor], str]:
    from tandem.models.gguf_parse import read_gguf

    reader = read_gguf(gguf_path)
    architecture = str(reader.fields["general.architecture"].contents())
    blocks = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if len(tensor.shape) != 2 or not gguf_blocks.supported(type_name):
            continue
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists the contiguous dimension first
        blocks[tensor.name] = gguf_blocks.to_quantized(np.asarray(tensor.data), type_name, shape)
    return blocks, architecture


def _source_id(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    return f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|layout {LAYOUT_VERSION}"


def _read_cache(blocks_file: Path, source: str) -> tuple[dict[str, QuantizedTensor], str, bool] | None:
    """(blocks, architecture, checked) as ``_write_cache`` wrote them for ``source``; None where the
    file is missing, damaged, of another source, or written before it kept the architecture."""
    from safetensors import safe_open

    if not blocks_file.is_file():
        return None
    try:
        with safe_open(str(blocks_file), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("source") != source or "architecture" not in meta:
                return None
            layout = json.loads(meta["tensors"])
            blocks = {
                name: QuantizedTensor(
                    f.get_tensor(f"{name}/packed"), f.get_tensor(f"{name}/scale"),
                    f.get_tensor(f"{name}/mins") if spec["mins"] else None,
                    spec["group"], spec["bits"], spec["zero"], spec["source"],
                )
                for name, spec in layout.items()
            }
            return blocks, meta["architecture"], meta.get("checked", "1") == "1"
    except Exception as error:  # noqa: BLE001  a damaged cache (of any kind: safetensors has its own errors) is made again
        log.warning("ignoring the cached blocks in %s: %s", blocks_file, error)
        return None


def _write_cache(blocks_file: Path, blocks: dict[str, QuantizedTensor], architecture: str, source: str,
                 checked: bool = True) -> None:
    from safetensors.torch import save_file

    tensors, layout = {}, {}
    for name, weight in blocks.items():
        tensors[f"{name}/packed"] = weight.packed
        tensors[f"{name}/scale"] = weight.scale
        if weight.mins is not None:
            tensors[f"{name}/mins"] = weight.mins
        layout[name] = {"group": weight.group, "bits": weight.bits, "zero": weight.zero, "source": weight.source,
                        "mins": weight.mins is not None}
    tmp = blocks_file.with_name(f"{blocks_file.name}.tmp{os.getpid()}")
    metadata = {"source": source, "architecture": architecture, "tensors": json.dumps(layout),
                "checked": "1" if checked else "0"}
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.rename(blocks_file)
