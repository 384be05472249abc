"""Linear layers on CPU, for the few rows decoding computes and the many a prefill does.

Decoding multiplies 1 to k+1 rows by every weight matrix, so a step is bound by reading the
weights once (gemma-3-270m in float32: 400 MB of layers and a 671 MB [262144, 640] LM head).
``F.linear`` goes to MKL, whose float32 GEMM takes a slow path on the AMD CPUs tandem is measured
on, far below memory bandwidth for a few rows. oneDNN (``torch.ops.mkldnn``, the library
inductor's CPU freezing pass uses) runs the same product from a copy of the weight reordered once
into its blocked layout, near bandwidth for one to eight rows and faster than ``F.linear`` up to a
prefill's row counts. So wide verification passes cost little more than a one-token step.

``install_cpu_linears`` gives every float32 CPU ``nn.Linear`` such a packed copy (the weight's
size once more, beside a tied embedding that must keep its plain layout for lookups) and routes
its inference calls through it; a weight changed later is packed again at its next call.
Invariant: the same arithmetic up to float summation order (differences ~1e-4 on logits of ~30,
like those between ``F.linear`` over one row and over six), and the engine computes every logit of
a session, autoregressive or verifying, through this one path.

Where the packed product is missing (a torch built without oneDNN) or fails its check at install,
the weights-stationary ``few_row_linear`` below serves the few-row calls instead. ``F.linear(x, W)``
computes ``x @ W.T``, and for a handful of rows MKL's transposed-B path runs far below memory
bandwidth; ``(W @ x.T).T`` streams W row by row. MKL's one- and three-column products are slower
than its two- and four-column ones, so odd chunks get one row of padding, and rows go in chunks of
four, the widest product MKL runs at bandwidth. Four-column products over a long inner dimension
fall off that path, so such weights keep a copy cut along the inner dimension into contiguous
[out, 1024] slices, up to ``MAX_SPLIT_BYTES`` per model, and four-column products sum the slices'
products (taken at install: weights changed later need ``install_cpu_linears`` again). That path
hands the LM head's logits back as the transposed view of the product ([rows, vocab] with strides
(1, columns)): consumers reduce over the vocabulary, which reads a strided row as fast as a
contiguous one, while copying it would cost a measurable share of the pass.

How fast oneDNN's packed product is for one or two rows depends on the host: on some it is
slower than for four, and then ``tandem.cpu.row_plans`` pads such calls or sends them to
``few_row_linear`` (``row_plan``, chosen by timing once at load).

Only CPU weights in inference are changed: CUDA has its own GEMMs, and training keeps autograd's
usual path. The model loader packs float32 layers; the eagle drafter packs its bfloat16 head the
same way (``dtype``), which halves a draft step there; bfloat16 layers without a packed copy keep
their own kernels.

Figures (pass costs by rows, each constant below): docs/target.md#packed-linears.
"""

from __future__ import annotations

import logging
from types import MethodType

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PACK_ROWS_HINT = 4  # the row count oneDNN lays a packed weight out for (1 makes 4-8 rows slower)
CHUNK_ROWS = 4  # the widest product MKL runs at memory bandwidth
MAX_ROWS = 16  # beyond this F.linear is as fast as the weights-stationary product
K_SLICE = 1024  # inner-dimension slice of the split copies (four columns x 1024 floats: 16 KB)
MAX_SPLIT_BYTES = 256 * 2**20  # the most memory the split copies of one model may take
# Row plans (``tandem.cpu.row_plans``): how a packed layer serves a call of a given row count when
# the packed product itself is not the fastest on this host.
PAD = "pad"  # padded_linear
FEW = "few"  # few_row_linear
_CHECK_ROWS = 64  # output features compared with a plain product when a packed copy is made
_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # rtol = atol of that comparison


def install_cpu_linears(model: torch.nn.Module, device: str, dtype: torch.dtype = torch.float32) -> int:
    """Makes every ``nn.Linear`` of a CPU model whose weight is ``dtype`` compute through oneDNN's
    packed copy of its weight; returns how many layers it changed.

    Without a packed copy, float32 layers use ``few_row_linear`` and other dtypes ``F.linear``.
    """
    if torch.device(device).type != "cpu":
        return 0
    installed = 0
    packed_bytes = split_bytes = 0
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module.weight.dtype != dtype:
            continue
        weight = module.weight.detach()
        size = weight.numel() * weight.element_size()
        module.packed_weight = PackedWeight()
        if module.packed_weight.get(module.weight) is not None:  # packed now, not at the first request
            packed_bytes += size
        elif dtype != torch.float32:
            continue
        else:
            module.few_row_contiguous = module is not head
            if weight.shape[1] > K_SLICE and split_bytes + size <= MAX_SPLIT_BYTES:
                module.few_row_slices = split_inner(weight)
                split_bytes += size
        module.forward = MethodType(_linear_forward, module)
        installed += 1
    log.debug("%d %s linear layers: %.0f MB of oneDNN-packed weights, %.0f MB of split copies",
              installed, dtype, packed_bytes / 2**20, split_bytes / 2**20)
    return installed


class PackedWeight:
    """oneDNN's packed copy of one layer's weight, made again when the weight has changed since
    (in place, by ``Module.to``, replaced, or as a ``copy.deepcopy`` of the model, which cannot copy
    oneDNN's opaque tensors and gets an empty holder instead). Writes through ``weight.data`` escape
    the version counter that tells: after those, call ``install_cpu_linears`` again."""

    def __init__(self) -> None:
        self._packed: torch.Tensor | None = None
        self._key: tuple | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of ``weight`` as it is now, or None where it cannot have one."""
        key = _identity(weight)
        if key != self._key:
            self._packed, self._key = pack_weight(weight.detach()), key
        return self._packed

    def __deepcopy__(self, memo: dict) -> PackedWeight:
        return PackedWeight()


def _identity(weight: torch.Tensor) -> tuple:
    try:
        version = weight._version  # bumped by every in-place change
    except RuntimeError:  # an inference tensor has no version counter (and cannot change in place)
        version = -1
    return id(weight), weight.data_ptr(), weight.dtype, tuple(weight.shape), version


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a float32 or bfloat16 CPU ``weight`` [out, in] for ``packed_linear``,
    or None where this torch cannot make one or its product does not match a plain one."""
    if weight.device.type != "cpu" or weight.dtype not in _CHECK_TOLERANCE:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        probe = torch.linspace(-1.0, 1.0, 2 * weight.shape[1]).view(2, -1).to(weight.dtype)  # [2, in]
        got = packed_linear(probe, packed)[:, :_CHECK_ROWS].float()  # [2, check]
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        log.info("no oneDNN-packed %s linear weights in this torch (%s)", weight.dtype, exc)
        return None
    expected = probe.float() @ weight[:_CHECK_ROWS].float().T  # [2, check]
    tolerance = _CHECK_TOLERANCE[weight.dtype]
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=tolerance, atol=tolerance):
        log.warning("oneDNN's packed %s product disagrees with a plain one; not using it", weight.dtype)
        return None
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from ``pack_weight(weight)``; x [..., in] -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def padded_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``packed_linear`` over x's rows padded with zeros to ``PACK_ROWS_HINT`` (the padding's
    products are dropped): where oneDNN's one- or two-row product is slower than its four-row one."""
    rows = x.reshape(-1, x.shape[-1])  # [m, in]
    m = rows.shape[0]
    if m >= PACK_ROWS_HINT:
        return packed_linear(x, packed, bias)
    padded = torch.cat([rows, rows.new_zeros(PACK_ROWS_HINT - m, rows.shape[1])])  # [hint, in]
    out = packed_linear(padded, packed, bias)[:m]  # [m, out]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def split_inner(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``weight`` [out, in] cut along ``in`` into contiguous [out, <= K_SLICE] copies."""
    return tuple(weight[:, start : start + K_SLICE].contiguous() for start in range(0, weight.shape[1], K_SLICE))


def few_row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    slices: tuple[torch.Tensor, ...] | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed as ``weight @ rows.T`` when x has few rows.

    ``slices`` (from :func:`split_inner` of the same weight) serve the four-column products.
    ``contiguous=False`` may return a transposed view (the same values, strides (1, columns))."""
    rows = x.reshape(-1, x.shape[-1])  # [m, in]
    m = rows.shape[0]
    if (
        m == 0
        or m > MAX_ROWS
        or rows.dtype != weight.dtype
        or weight.device.type != "cpu"
        or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
    ):
        return F.linear(x, weight, bias)
    parts = []
    for start in range(0, m, CHUNK_ROWS):
        chunk = rows[start : start + CHUNK_ROWS]  # [c, in]
        # MKL's one- and three-column products are slower than its two- and four-column ones.
        padded = torch.cat([chunk, chunk[:1]]) if chunk.shape[0] % 2 else chunk  # [c rounded up to even, in]
        if slices is not None and padded.shape[0] > 2:
            product = _sliced_product(slices, padded)  # [out, c]
        else:
            product = weight @ padded.T  # [out, c]
        parts.append(product.T[: chunk.shape[0]])  # [c, out]
    if len(parts) > 1:
        out = torch.cat(parts)  # [m, out]
    else:
        out = parts[0].contiguous() if contiguous else parts[0]  # [m, out]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _sliced_product(slices: tuple[torch.Tensor, ...], rows: torch.Tensor) -> torch.Tensor:
    """``weight @ rows.T`` [out, c] as the sum of each inner slice's product."""
    out = None
    start = 0
    for piece in slices:  # [out, width]
        width = piece.shape[1]
        product = piece @ rows[:, start : start + width].T  # [out, c]
        out = product if out is None else out.add_(product)
        start += width
    return out


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if (
        x.dim() > 1
        and x.numel() > 0
        and x.dtype == weight.dtype
        and x.device.type == weight.device.type == "cpu"
        and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
    ):
        packed = self.packed_weight.get(weight)
        plan = self.row_plan.get(x.numel() // x.shape[-1]) if getattr(self, "row_plan", None) else None
        if packed is not None and plan != FEW:
            return padded_linear(x, packed, self.bias) if plan == PAD else packed_linear(x, packed, self.bias)
    if weight.dtype == torch.float32:
        return few_row_linear(x, weight, self.bias, getattr(self, "few_row_slices", None),
                              getattr(self, "few_row_contiguous", True))
    return F.linear(x, weight, self.bias)
