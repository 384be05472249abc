"""Loading a SPEC for inference, shared by the target and the draft: device, dtype, the GGUF's own
quantized blocks where the host has a kernel for them, and the tokenizer's fingerprint."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.models import specs

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any  # transformers PreTrainedTokenizerBase; None where loaded without (load_model)
    hf_dir: Path
    dtype: str  # "float32", "bfloat16", "float16": what activations are computed in
    device: str  # "cpu", "cuda", "cuda:0", ...
    # "quantized:Q4_K,Q8_0,..." where the weights are the GGUF file's own blocks (tandem.quant), else ""
    quantization: str = ""

    @property
    def weights(self) -> str:
        """What Info reports as the model's dtype: the quantization, else the float dtype."""
        return self.quantization or self.dtype


def pick_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def pick_dtype(dtype: str, device: str) -> str:
    """The float dtype activations (and unquantized weights) are computed in."""
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise specs.ModelSpecError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return dtype


def load_tokenizer(spec: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(specs.resolve(spec).hf_dir))


def load_model(spec: str, device: str = "auto", dtype: str = "auto", name: str | None = None,
               with_tokenizer: bool = True) -> LoadedModel:
    """Loads a causal LM and its tokenizer from a SPEC, for inference.

    ``dtype="auto"`` on a CPU computes a GGUF model on its file's own quantized blocks, through the
    kernel the host's probe picks (``tandem.quant.native``: int8 activations with VNNI, else
    float32); ``"float32"`` on their exact float32 dequantization. ``with_tokenizer=False`` leaves
    the tokenizer to load when needed (a target: ``tandem.models.tokenizer_facts``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.cpu.linear import install_cpu_linears
    from tandem.cpu.row_plans import tune_row_plans

    resolved = specs.resolve(spec)
    device = pick_device(device)
    requested, dtype = dtype, pick_dtype(dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.hf_dir)) if with_tokenizer else None
    model = AutoModelForCausalLM.from_pretrained(
        str(resolved.hf_dir), dtype=getattr(torch, dtype)
    )
    model.to(device)
    model.eval()
    quantization = ""
    if requested == "auto" and device == "cpu" and resolved.gguf is not None:
        quantization = _quantize(model, resolved)
    if install_cpu_linears(model, device):
        tune_row_plans(model)
    return LoadedModel(name or resolved.name, model, tokenizer, resolved.hf_dir, dtype, device, quantization)


def _quantize(model: Any, resolved: specs.ResolvedSpec) -> str:
    """Computes the model on its GGUF file's blocks where this host has the kernel for it (see
    ``tandem.quant``); returns the quantization Info reports, or "" where it keeps float32."""
    from tandem.quant.checkpoint import BLOCKS_FILE, quantize_model
    from tandem.quant.native import KernelUnavailable, load_kernel

    try:
        kernel = load_kernel()
    except KernelUnavailable as reason:
        log.warning("%s: computing on float32 dequantized weights instead (%s)", resolved.name, reason)
        return ""
    summary = quantize_model(model, resolved.gguf, resolved.hf_dir / BLOCKS_FILE, kernel)
    if not summary.swapped:
        log.warning("%s: no tensor of %s is in a block type tandem computes on; float32 weights", resolved.name,
                    resolved.gguf.name)
        return ""
    log.info("%s: %s", resolved.name, summary.describe())
    return summary.dtype


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable hash of what makes two tokenizers interchangeable: vocabulary and special ids.

    Two services may only exchange token ids when their fingerprints are equal.
    """
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    for token, idx in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    specials = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "unk": tokenizer.unk_token_id,
    }
    digest.update(json.dumps(specials, sort_keys=True).encode())
    return digest.hexdigest()[:32]
