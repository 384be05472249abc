"""The feature-conditioned (EAGLE-style) draft head, its checkpoint format and the target tensors it borrows.

The head never sees tokens the way a language model does. It takes the target's final hidden state
at position t (post final norm: exactly what the target's LM head multiplies) and the target's
embedding of token t+1, and predicts the target's final hidden state at t+1. That predicted state
goes through the target's own LM head, restricted to a reduced vocabulary (the rows of the tokens
the target actually emits most), to give token t+2. Drafting K tokens feeds the predicted state
forward K times, so the head is trained on its own rollouts, not only one step ahead.

Why this shape: the target's features already encode almost everything about the next token, so a
two-layer MLP agrees with the target far more often than a small standalone LM; and borrowing the
target's embedding and head rows keeps the shipped head a few MB (gemma-3-270m's 262k-row head is
two thirds of that model).

A checkpoint is a directory::

    eagle.json          EagleConfig (json)
    head.safetensors    the head's weights, plus ``vocab_ids`` [reduced] int64 (reduced -> target id)
    acceptance.json     optional: how often its drafts were accepted, by source and depth, where it
                        was measured (``benchmarks/draft_replay.py --save-prior``); the draft
                        service's block-length policy starts from it
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.cpu.linear import few_row_linear, install_cpu_linears, pack_weight, packed_linear
from tandem.quant.gguf_blocks import from_float
from tandem.quant.modules import QuantLinear, product
from tandem.quant.native import QuantKernel
from tandem.quant.reference import dequantize
from tandem.quant.tensor import QuantizedTensor
from tandem.models import BUILTIN_HEADS_DIR  # built-in target name -> its head's folder under tandem/data/eagle/

log = logging.getLogger(__name__)

CONFIG_FILE = "eagle.json"
WEIGHTS_FILE = "head.safetensors"
ACCEPTANCE_FILE = "acceptance.json"  # optional: measured acceptance by draft source (draft_service.block_length)
Q8_0_GROUP = 32  # inputs per Q8_0 block: a quantized head's layers take multiples of it
# Past this many bytes of fp32 head rows (the L3 cache of a small CPU), few_row_linear beats F.linear.
LARGE_HEAD_BYTES = 24 * 2**20


class EagleCheckpointError(ValueError):
    """A head directory that cannot be loaded, or that belongs to another target."""


@dataclass
class EagleConfig:
    hidden_size: int  # the target's hidden size (features and embeddings)
    inner_size: int  # the MLP's width
    num_layers: int  # hidden layers of the MLP (>= 1)
    reduced_vocab_size: int  # rows of the restricted LM head
    target_vocab_size: int
    target_model: str  # the target's SPEC or built-in name it was trained for
    target_fingerprint: str  # tandem.models.tokenizer_fingerprint of the target's tokenizer
    embed_tensor: str = "model.embed_tokens.weight"  # the target's input embedding in its safetensors
    head_tensor: str = "model.embed_tokens.weight"  # the target's LM head rows (tied for Gemma)
    logit_softcap: float | None = None  # the target's final_logit_softcapping
    metadata: dict[str, Any] = field(default_factory=dict)  # how it was trained, what it measured


def target_mismatches(config: EagleConfig, fingerprint: str, hidden_size: int, vocab_size: int) -> list[str]:
    """What differs between the target a head was trained for and this one (empty: it fits).

    A head's features and token ids mean nothing for another target. ``hidden_size`` 0 means not
    known, not checked (a target's Info may leave it out)."""
    problems = []
    if config.target_fingerprint != fingerprint:
        problems.append(f"tokenizer fingerprint {config.target_fingerprint} (head) vs {fingerprint or 'none'} (target)")
    if hidden_size and config.hidden_size != hidden_size:
        problems.append(f"hidden size {config.hidden_size} (head) vs {hidden_size} (target)")
    if config.target_vocab_size != vocab_size:
        problems.append(f"vocabulary size {config.target_vocab_size} (head) vs {vocab_size} (target)")
    return problems


class EagleHead(nn.Module):
    """(feature_t, embed(token_{t+1})) -> predicted feature_{t+1}.

    Both inputs are RMS-normalised first: features and Gemma's embeddings live on very different
    scales. The output is a residual on the input feature, which is what it most resembles.
    """

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        h, inner = config.hidden_size, config.inner_size
        self.config = config
        self.norm_feature = nn.RMSNorm(h, eps=1e-6)
        self.norm_embed = nn.RMSNorm(h, eps=1e-6)
        layers: list[nn.Module] = [nn.Linear(2 * h, inner)]
        for _ in range(config.num_layers - 1):
            layers += [nn.SiLU(), nn.Linear(inner, inner)]
        layers += [nn.SiLU(), nn.Linear(inner, h)]
        self.mlp = nn.Sequential(*layers)
        self.out_scale = nn.Parameter(torch.ones(h))

    def forward(self, feature: torch.Tensor, token_embed: torch.Tensor) -> torch.Tensor:
        # feature, token_embed: [..., hidden] -> [..., hidden]
        x = torch.cat([self.norm_feature(feature), self.norm_embed(token_embed)], dim=-1)  # [..., 2*hidden]
        return feature + self.out_scale * self.mlp(x)


@dataclass
class TargetTensors:
    """The only target weights the drafter needs."""

    # [target_vocab, hidden]: float (may stay bf16; rows are cast on lookup), or the converted GGUF's
    # own blocks of it (tandem.quant.checkpoint.cached_embedding), rows dequantized on lookup
    embed: torch.Tensor | QuantizedTensor
    head_rows: torch.Tensor  # [reduced_vocab, hidden] float32: LM head rows of the reduced vocabulary


def load_target_tensors(hf_dir: Path, config: EagleConfig, vocab_ids: torch.Tensor) -> TargetTensors:
    """Reads the embedding and the reduced head rows from the target's safetensors, nothing else."""
    from safetensors import safe_open

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in {config.embed_tensor, config.head_tensor} - found.keys():
                if name in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                    found[name] = f.get_tensor(name)
    missing = {config.embed_tensor, config.head_tensor} - found.keys()
    if missing:
        raise EagleCheckpointError(f"target checkpoint {hf_dir} has no tensor(s) {sorted(missing)}")
    embed = found[config.embed_tensor]
    if tuple(embed.shape) != (config.target_vocab_size, config.hidden_size):
        raise EagleCheckpointError(
            f"target embedding is {tuple(embed.shape)}, the head was trained for "
            f"({config.target_vocab_size}, {config.hidden_size})"
        )
    head_rows = found[config.head_tensor].index_select(0, vocab_ids).float().contiguous()
    return TargetTensors(embed=embed, head_rows=head_rows)


class EagleDrafter:
    """A loaded head plus the target tensors: one drafting step at a time, batched over rows.

    ``dtype`` is what a step computes in. A step is one row per session, so it is bound by reading
    the head's weights and its reduced LM-head rows, and on a CPU it runs right after a target pass
    has flushed the caches: every byte of the working set counts. In bfloat16 it is half of
    float32's; with a quantized ``kernel`` (``tandem.quant``) the head's products and LM-head rows
    are Q8_0 blocks, a byte per weight and a scale per 32 (the rows are the target's tied
    embedding, which a Q8_0 GGUF holds in exactly that form), and the rest of the step is float32.
    ``vocab_limit`` keeps the most frequent target choices only: nearly all of the target's choices
    fall among them, and fewer rows make each step cheaper (figures: docs/drafting.md#draft-rows).
    """

    def __init__(
        self,
        head: EagleHead,
        vocab_ids: torch.Tensor,
        target: TargetTensors,
        *,
        dtype: torch.dtype = torch.float32,
        vocab_limit: int = 0,
        kernel: QuantKernel | None = None,
    ) -> None:
        if vocab_limit < 0:
            raise ValueError(f"vocab_limit must be >= 0, got {vocab_limit}")
        keep = vocab_ids.numel() if vocab_limit == 0 else min(vocab_limit, vocab_ids.numel())
        if kernel is not None and any(m.in_features % Q8_0_GROUP for m in head.mlp if isinstance(m, nn.Linear)):
            log.info("eagle head: layer widths are not multiples of %d; steps in %s instead of Q8_0", Q8_0_GROUP, dtype)
            kernel = None
        if kernel is not None:
            dtype = torch.float32  # around the quantized products
        self.head = head.eval().to(dtype)
        self.config = head.config
        self.dtype = dtype
        self.kernel = kernel
        # The reduced vocabulary is ordered by how often the target chose each token, so a prefix
        # is the best set of its size.
        self.vocab_ids = vocab_ids[:keep]  # [reduced] int64, reduced index -> target id
        self.target = TargetTensors(embed=target.embed, head_rows=target.head_rows[:keep].to(dtype).contiguous())
        self._quantized_rows: QuantizedTensor | None = None
        self._packed_rows = None
        if kernel is not None:
            for name, module in list(self.head.mlp.named_children()):
                if isinstance(module, nn.Linear):
                    setattr(self.head.mlp, name, QuantLinear.from_linear(module, kernel))
            self._quantized_rows = kernel.prepare(from_float(self.target.head_rows))
            return
        # On a CPU both the head's layers and the LM-head rows compute through oneDNN-packed copies
        # (``tandem.cpu.linear``): half the time of a plain product, bf16 or float32.
        device = str(self.target.head_rows.device)
        install_cpu_linears(self.head, device, dtype)
        self._packed_rows = pack_weight(self.target.head_rows)  # None off the CPU or without oneDNN

    @property
    def weights(self) -> str:
        """What a step reads its weights as, for logs: "Q8_0 (KERNEL)", "bfloat16", ..."""
        if self.kernel is not None:
            return f"Q8_0 ({self.kernel.isa})"
        return str(self.dtype).removeprefix("torch.")

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # [b] -> [b, hidden] in the step's dtype
        table = self.target.embed
        if isinstance(table, QuantizedTensor):
            return dequantize(table.rows(token_ids.cpu())).to(token_ids.device, self.dtype)
        return table.index_select(0, token_ids).to(self.dtype)

    @torch.inference_mode()
    def step(self, feature: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feature [b, hidden] at t, token_ids [b] at t+1 -> (feature [b, hidden] at t+1, logits [b, reduced] float32)."""
        predicted = self.head(feature.to(self.dtype), self.embed(token_ids))  # [b, hidden]
        logits = self._logits(predicted)  # [b, reduced]
        cap = self.config.logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return predicted, logits

    def _logits(self, predicted: torch.Tensor) -> torch.Tensor:
        # predicted [b, hidden] -> [b, reduced] float32
        if self._quantized_rows is not None:
            return product(self.kernel, predicted.float().contiguous(), self._quantized_rows)
        if self._packed_rows is not None:
            return packed_linear(predicted, self._packed_rows).float()
        rows = self.target.head_rows  # [reduced, hidden]
        if self.dtype == torch.float32 and rows.numel() * rows.element_size() > LARGE_HEAD_BYTES:
            return few_row_linear(predicted, rows)  # MKL's few-row path is slow on matrices past the cache
        return torch.nn.functional.linear(predicted, rows).float()


def save_head(directory: Path, head: EagleHead, vocab_ids: torch.Tensor, dtype: torch.dtype = torch.float16) -> None:
    """Writes ``eagle.json`` and ``head.safetensors`` (weights in ``dtype``, vocab ids int64)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in head.state_dict().items()}
    tensors["vocab_ids"] = vocab_ids.to(torch.int64).contiguous()
    tmp = directory / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp))
    tmp.chmod(0o644)  # safetensors writes owner-only files; a shipped head must be readable by all
    tmp.replace(directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(asdict(head.config), indent=2, sort_keys=True) + "\n")


def is_head_dir(path: Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def load_head(directory: Path) -> tuple[EagleHead, torch.Tensor]:
    """(head in float32, eval mode; vocab_ids [reduced] int64)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not is_head_dir(directory):
        raise EagleCheckpointError(f"{directory} is not an eagle head directory (no {CONFIG_FILE})")
    try:
        config = EagleConfig(**json.loads((directory / CONFIG_FILE).read_text()))
    except (TypeError, ValueError) as exc:
        raise EagleCheckpointError(f"{directory / CONFIG_FILE} is not a valid eagle config: {exc}") from exc
    tensors = load_file(str(directory / WEIGHTS_FILE))
    vocab_ids = tensors.pop("vocab_ids")
    if vocab_ids.shape != (config.reduced_vocab_size,):
        raise EagleCheckpointError(f"vocab_ids has shape {tuple(vocab_ids.shape)}, config says {config.reduced_vocab_size}")
    head = EagleHead(config)
    head.load_state_dict({name: t.float() for name, t in tensors.items()})
    return head.eval(), vocab_ids


def builtin_head_dir(target_name: str) -> Path | None:
    """The shipped head for a built-in target, if there is one."""
    path = BUILTIN_HEADS_DIR / target_name
    return path if is_head_dir(path) else None


__all__ = [
    "ACCEPTANCE_FILE",
    "EagleCheckpointError",
    "EagleConfig",
    "EagleDrafter",
    "EagleHead",
    "TargetTensors",
    "builtin_head_dir",
    "is_head_dir",
    "load_head",
    "load_target_tensors",
    "save_head",
    "target_mismatches",
]
