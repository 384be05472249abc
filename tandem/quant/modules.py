"""``nn.Linear`` and ``nn.Embedding`` stand-ins that keep their weight quantized.

A model's linear layers and embedding are replaced module for module (``tandem.quant.checkpoint``),
so transformers' own forward runs unchanged; only the products read the low-bit blocks. Inputs are
computed in float32 (the kernel's accumulation type) and cast back to their own dtype.

Invariant: a row's output depends only on that row, not on the rows beside it in the call (the
kernels fix each output's order of operations; with the float32 kernel, calls of more than
``DENSE_ROWS`` rows, a long prompt chunk, go through a float32 GEMM of the dequantized weight
instead, where the arithmetic intensity pays for the dequantization). So a verification pass
scores a position with exactly the logits an autoregressive step gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from tandem.quant.native import QuantKernel, tiles_op
from tandem.quant.reference import dequantize
from tandem.quant.tensor import QuantizedTensor

DENSE_ROWS = 64  # float32 kernel: calls with more rows dequantize the weight and run a float32 GEMM


class _Quantized(nn.Module):
    """Holds a :class:`QuantizedTensor` as buffers (``Module.to`` moves them; not saved: they come from the GGUF file)."""

    def _hold(self, weight: QuantizedTensor) -> None:
        self.group, self.bits, self.zero, self.source = weight.group, weight.bits, weight.zero, weight.source
        self.layout = weight.layout
        self.register_buffer("packed", weight.packed, persistent=False)
        self.register_buffer("scale", weight.scale, persistent=False)
        self.register_buffer("mins", weight.mins, persistent=False)

    @property
    def quantized(self) -> QuantizedTensor:
        return QuantizedTensor(self.packed, self.scale, self.mins, self.group, self.bits, self.zero, self.source,
                               self.layout)

    @property
    def weight(self) -> torch.Tensor:
        """The float32 weight (dequantized on each access: for checks and tools, not for decoding)."""
        return dequantize(self.quantized)


class QuantLinear(_Quantized):
    """``y = x @ W.T + bias`` with ``W`` a :class:`QuantizedTensor` [out, in]."""

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None, kernel: QuantKernel) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._hold(kernel.prepare(weight))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.kernel = kernel

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel: QuantKernel, type_name: str = "Q8_0") -> QuantLinear:
        """A float ``nn.Linear`` quantized into ``type_name`` blocks (``gguf_blocks.from_float``)."""
        from tandem.quant.gguf_blocks import from_float

        return cls(from_float(linear.weight, type_name), linear.bias, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()  # [m, in]
        out = product(self.kernel, rows, self.quantized)  # [m, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {self.source} as {self.bits}-bit {self.layout}, "
                f"kernel={self.kernel.isa}")


class QuantEmbedding(_Quantized):
    """An embedding lookup that dequantizes only the rows it is asked for, times ``scale`` (Gemma
    multiplies its embeddings by sqrt(hidden size); 1 elsewhere)."""

    def __init__(self, weight: QuantizedTensor, scale: torch.Tensor | float = 1.0, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx
        self._hold(weight)
        self.register_buffer("embed_scale", torch.as_tensor(scale, dtype=torch.float32), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)  # [n]
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        rows = dequantize(self.quantized.rows(flat))  # [n, dim]
        return (rows * self.embed_scale).reshape(*input_ids.shape, self.embedding_dim)


def product(kernel: QuantKernel, rows: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """rows [m, in] float32 contiguous @ weight.T -> [m, out]: the kernel, or for more than
    ``DENSE_ROWS`` rows with float32 activations a GEMM of the dequantized weight (see the module docstring)."""
    if rows.shape[0] > DENSE_ROWS and kernel.activations == "float32":
        return rows @ dequantize(weight).T
    return kernel.matmul(rows, weight)


def bound_product(kernel: QuantKernel, weight: QuantizedTensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`product` with ``weight``, its kernel call resolved once: rows [m, in] float32 contiguous
    -> [m, out]. A decode step makes ~70 small products; looking up the op and its arguments on each
    costs as much as a small product's arithmetic (figures: docs/target.md#quantized-cpu-kernels)."""
    op = tiles_op(kernel, weight)
    if op is None:
        return partial(product, kernel, weight=weight)
    arguments = (weight.packed, weight.scale, weight.mins, weight.group, weight.bits, weight.zero, weight.shape[0])
    return lambda rows: op(rows, *arguments)


def int8_activations(model: nn.Module) -> bool:
    """Whether any layer of ``model`` quantizes its activations (the int8 kernel)."""
    return int8_kernel_isa(model) is not None


def int8_kernel_isa(model: nn.Module) -> str | None:
    """The build of the first of ``model``'s layers that quantizes its activations, or None."""
    return next((m.kernel.isa for m in model.modules() if isinstance(m, QuantLinear) and m.kernel.activations == "int8"),
                None)
