"""The quantized product's native kernels: which build this host runs, and the build.

Kernels, C++ compiled on first use by PyTorch's extension builder into the tandem cache
(``$TANDEM_CACHE_DIR/kernels``, one folder per instruction set, sources and torch install; about
11 s once on 2 cores, then a load). Each instruction set's product, row attention and decoder ops
(and for the int8 builds a whole decoder layer, which calls them) are one translation unit (a small
generated file including the sources), so the torch headers, most of a build's time, are parsed
once rather than once per source (26 -> 11 s):

* ``avx512vnni`` (``qmatmul_vnni.cpp``): activations quantized to int8 per group, integer products
  by vpdpbusd, weights in the ``TILES`` layout. A pass costs about the same for one to eight rows.
* ``avx2int8`` (``qmatmul_int8_avx2.cpp``): the same semantics and layout on AVX2, the integer
  products by vpmaddubsw and vpmaddwd, as llama.cpp computes on CPUs without VNNI.
* ``avx512`` / ``avx2`` (``qmatmul.cpp``): float32 activations times the exactly dequantized weight;
  a pass of eight rows costs about twice one of a single row.

Which one is a probe at start-up: ``avx512vnni`` where PyTorch's CPU capability
(``torch.backends.cpu.get_cpu_capability()``, which honours ``ATEN_CPU_CAPABILITY``) is AVX-512 and
the CPU has VNNI, ``avx512`` where it is AVX-512 without VNNI, ``avx2int8`` where it is AVX2;
``TANDEM_QUANT_KERNEL`` (``auto`` | ``avx512vnni`` | ``avx512`` | ``avx2int8`` | ``avx2`` | ``none``)
overrides it. A build is used only after it
matches its PyTorch reference on a check; where there is none (no compiler, an older CPU, a failed
check) the caller keeps float32 weights instead, and the log says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.quant import reference
from tandem.quant.tensor import ROWS, TILE, TILES, QuantizedTensor, pack, to_tiles

log = logging.getLogger(__name__)

SOURCES = {
    "float32": Path(__file__).with_name("qmatmul.cpp"),
    "int8": Path(__file__).with_name("qmatmul_vnni.cpp"),
    "int8_avx2": Path(__file__).with_name("qmatmul_int8_avx2.cpp"),
    "attention": Path(__file__).with_name("row_attention.cpp"),  # the row-exact attention int8 activations need
    "decoder": Path(__file__).with_name("decoder_ops.cpp"),  # a decoder layer's norms, rotary and gate in one call each
    "layer": Path(__file__).with_name("decoder_layer.cpp"),  # a whole decoder layer in one call (int8 builds only)
}
OPS_KINDS = ("attention", "decoder")  # sources of ops beside the products: their libraries are named by kind
INT8_OPS_KINDS = ("layer",)  # and those only the int8 builds compile (they call the int8 product)
ENV = "TANDEM_QUANT_KERNEL"
ISA_FLAGS = {
    "avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx2", "-mfma", "-mf16c"],
    "avx2int8": ["-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
# Builds with int8 activations and the TILES layout, and the source each compiles.
INT8_SOURCES = {"avx512vnni": "int8", "avx2int8": "int8_avx2"}
INT8_ISAS = tuple(INT8_SOURCES)
# PyTorch stand-ins of each kind, for tests: QuantKernel("reference") and QuantKernel("reference-int8").
REFERENCES = {"reference": "float32", "reference-int8": "int8"}
# What the probe adds to an AVX-512 capability before it picks the VNNI build.
VNNI_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
# The CPU flags each build's instructions need (/proc/cpuinfo names; runs_here).
CPU_FLAGS_NEEDED = {
    "avx512vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx2", "fma", "f16c"},
    "avx2int8": {"avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
}
# torch.backends.cpu.get_cpu_capability() -> the build that runs on it ("DEFAULT", "VSX", ...: none).
CAPABILITY_ISA = {"AVX512": "avx512", "AVX512_BF16": "avx512", "AMX": "avx512", "AVX2": "avx2int8"}
MAX_ROWS = 8  # rows the kernel multiplies per pass over a weight (MAX_ROWS in qmatmul.cpp)
# Builds that multiply fewer rows per pass over a weight (MAX_ROWS of their source: AVX2 has 16 vector registers).
SWEEP_ROWS = {"avx2int8": 4}


class KernelUnavailable(RuntimeError):
    """No native build for this host (the message says why)."""


@dataclass(frozen=True)
class QuantKernel:
    """One loaded build of the kernel, or the PyTorch reference (``isa`` "reference")."""

    isa: str

    @property
    def activations(self) -> str:
        """What activations are computed in: "int8" (per group, as llama.cpp) or "float32"."""
        return "int8" if self.isa in INT8_ISAS else REFERENCES.get(self.isa, "float32")

    @property
    def rows_per_sweep(self) -> int:
        """Rows one read of a weight multiplies: more rows in a call cost the weight's arithmetic again."""
        return SWEEP_ROWS.get(self.isa, MAX_ROWS)

    def prepare(self, weight: QuantizedTensor) -> QuantizedTensor:
        """``weight`` in the layout this kernel reads (TILES for the int8 kernel, where the rows tile)."""
        if self.activations == "int8" and weight.layout == ROWS and weight.shape[0] % TILE == 0:
            return to_tiles(weight)
        return weight

    def matmul(self, x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
        """x [rows, in] float32 contiguous -> [rows, out] float32, ``weight`` as :meth:`prepare` left it."""
        out_features = weight.shape[0]
        tiles = tiles_op(self, weight)
        if tiles is not None:
            return tiles(x, weight.packed, weight.scale, weight.mins, weight.group, weight.bits, weight.zero,
                         out_features)
        if self.activations == "int8":  # rows that do not tile, or the reference build: the same, in PyTorch
            return reference.qmatmul_int8_activations(x, weight)
        if self.isa == "reference":
            return reference.qmatmul(x, weight.packed, weight.scale, weight.mins, weight.group, weight.bits,
                                     weight.zero, out_features)
        return _ops(self.isa).qmatmul(x, weight.packed, weight.scale, weight.mins, weight.group, weight.bits,
                                      weight.zero, out_features)


def tiles_op(kernel: QuantKernel, weight: QuantizedTensor):
    """The native op :meth:`QuantKernel.matmul` calls for ``weight`` as
    ``op(x, packed, scale, mins, group, bits, zero, out_features)``, or None where it calls anything else."""
    if kernel.activations == "int8" and weight.layout == TILES and kernel.isa not in REFERENCES:
        return _ops(kernel.isa).qmatmul_tiles
    return None


def probe() -> tuple[str | None, str]:
    """(the build this host should run or None, why), from ``TANDEM_QUANT_KERNEL`` or the CPU."""
    wanted = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if wanted == "none":
        return None, f"{ENV}=none"
    if wanted in ISA_FLAGS:
        return wanted, f"{ENV}={wanted}"
    if wanted != "auto":
        raise ValueError(f"{ENV} must be auto, {', '.join(ISA_FLAGS)} or none, got {wanted!r}")
    capability = torch.backends.cpu.get_cpu_capability()
    isa = CAPABILITY_ISA.get(capability)
    if isa == "avx512" and VNNI_FLAGS <= cpu_flags():
        return "avx512vnni", f"CPU capability {capability} with VNNI"
    return isa, f"CPU capability {capability}"


def runs_here(isa: str) -> bool:
    """Whether this CPU has every instruction the ``isa`` build uses."""
    return CPU_FLAGS_NEEDED[isa] <= cpu_flags()


def _refuse_what_cannot_run(isa: str) -> None:
    """Raises :class:`KernelUnavailable` for a build whose instructions this CPU lacks (where its flags
    are known): running one ends the process with SIGILL, which no caller could fall back from."""
    flags = cpu_flags()
    missing = CPU_FLAGS_NEEDED.get(isa, set()) - flags
    if flags and missing:
        raise KernelUnavailable(f"the {isa} build needs CPU flags this CPU lacks: {', '.join(sorted(missing))}")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


_LOADED: dict[str, QuantKernel] = {}


def load_kernel(isa: str | None = None) -> QuantKernel:
    """The native kernel for ``isa`` (default: the probe's choice), built if needed and checked
    against the reference. Raises :class:`KernelUnavailable` with the reason where there is none."""
    reason = f"asked for {isa}"
    if isa is None:
        isa, reason = probe()
        if isa is None:
            raise KernelUnavailable(f"no native quantized kernel for this host ({reason})")
    if isa in _LOADED:
        return _LOADED[isa]
    _refuse_what_cannot_run(isa)
    started = time.perf_counter()
    try:
        built = _build(isa)
    except Exception as error:  # no compiler, no ninja, a compile error: say so and let the caller fall back
        raise KernelUnavailable(f"the {isa} build of the quantized kernel failed: {str(error)[-400:]}") from error
    kernel = QuantKernel(isa)
    mismatch = _self_check(kernel)
    if mismatch:
        raise KernelUnavailable(f"the {isa} build of the quantized kernel disagrees with its reference: {mismatch}")
    _LOADED[isa] = kernel
    log.info("quantized CPU kernel: %s (%s; %s in %.1fs)", isa, reason, built, time.perf_counter() - started)
    return kernel


def available_kernels() -> list[str]:
    """The quantized builds this host runs (built now where they were not), best first."""
    found = []
    for isa in ISA_FLAGS:
        try:
            load_kernel(isa)
            found.append(isa)
        except KernelUnavailable:
            pass
    return found


def prebuild() -> list[str]:
    """Compiles into the tandem cache what a target on this host builds at its first start (the
    probe's kernels: product, row attention and decoder ops) where it is not built yet; returns
    the builds made. ``tandem serve`` runs it in a process of its own while it converts a GGUF on a
    first start, so the compiler and the conversion share the two cores rather than follow each
    other. A build that fails is left to the target, which says why and falls back."""
    isa, _ = probe()
    if isa is None or any(build_folder(isa).glob("*.so")):
        return []
    try:
        _build(isa)
    except Exception as error:  # noqa: BLE001  the target builds it again and reports the error
        log.warning("prebuilding the %s kernels failed: %s", isa, str(error)[-200:])
        return []
    return [isa]


def _library(isa: str, kind: str = "") -> str:
    return f"tandem_{kind}_{isa}" if kind else f"tandem_quant_{isa}"


def _ops(isa: str):
    return getattr(torch.ops, _library(isa))


def load_row_attention(isa: str):
    """``row_attention`` (row_attention.cpp) built for ``isa``'s instruction set; raises
    :class:`KernelUnavailable` where it cannot be built."""
    return getattr(_load_ops(isa, "attention"), "row_attention")


def load_decoder_ops(isa: str):
    """The namespace of decoder_ops.cpp's ops (``rms_norm``, ``add_rms_norm``, ``head_norm_rope``,
    ``gelu_tanh_mul``, ``argmax_rows``, ``mask_rows``) built for ``isa``; raises
    :class:`KernelUnavailable` where it cannot be built."""
    return _load_ops(isa, "decoder")


def load_decoder_layer(isa: str):
    """``decoder_layer`` (decoder_layer.cpp: a Gemma 3 decoder layer on int8 tiles in one call) built
    for ``isa``; raises :class:`KernelUnavailable` where it cannot be built or ``isa`` has no int8 product."""
    if isa not in INT8_ISAS:
        raise KernelUnavailable(f"{isa} has no int8 product for decoder_layer")
    return getattr(_load_ops(isa, "layer"), "decoder_layer")


def _load_ops(isa: str, kind: str):
    _refuse_what_cannot_run(isa)
    try:
        _build(isa)
    except Exception as error:  # noqa: BLE001  as for the products: say why, let the caller fall back
        raise KernelUnavailable(f"the {isa} build of {SOURCES[kind].name} failed: {str(error)[-400:]}") from error
    return getattr(torch.ops, _library(isa, kind))


def build_folder(isa: str) -> Path:
    """Where the ``isa`` build of the kernels lives in the tandem cache: one folder per instruction
    set, sources, flags, headers and torch install."""
    return _build_plan(isa)[2]


def _bundle(isa: str) -> dict[str, Path]:
    """The libraries one ``isa`` build registers, each with its source: the product kernel the
    instruction set runs, the row attention and the decoder ops (and, for int8 builds, the decoder
    layer, which calls the product: it comes last)."""
    product = SOURCES[INT8_SOURCES.get(isa, "float32")]
    kinds = OPS_KINDS + (INT8_OPS_KINDS if isa in INT8_SOURCES else ())
    return {_library(isa): product, **{_library(isa, kind): SOURCES[kind] for kind in kinds}}


def _build_plan(isa: str) -> tuple[str, list[str], Path, str]:
    """(the translation unit's text, flags, folder, digest) of an ``isa`` build."""
    from tandem.models import cache_dir

    flags = ["-O3", "-fopenmp", "-fno-math-errno", *ISA_FLAGS[isa]]
    bundle = _bundle(isa)
    # Each source registers its ops under the library name it is given (its TANDEM_QUANT_LIBRARY).
    unit = "".join(f'#define TANDEM_QUANT_LIBRARY {library}\n#include "{source.resolve()}"\n'
                   "#undef TANDEM_QUANT_LIBRARY\n" for library, source in bundle.items())
    # The torch install and the sources' paths are part of the key: the build file names the torch
    # headers and the sources by path, so another install's (a second virtual environment) or another
    # checkout's would make ninja rebuild the folder at every switch between them.
    key = " ".join([torch.__version__, str(Path(torch.__file__).resolve().parent), *flags])
    sources = b"".join(source.read_bytes() for source in bundle.values())
    headers = b"".join(path.read_bytes() for path in sorted(SOURCES["float32"].parent.glob("*.h")))  # what they include
    digest = hashlib.sha256(sources + headers + unit.encode() + key.encode()).hexdigest()[:12]
    return unit, flags, cache_dir() / "kernels" / f"kernels-{isa}-{digest}", digest


_BUILT: dict[str, str] = {}  # isa -> what its build did in this process ("built" or "loaded")


def _build(isa: str) -> str:
    """Compiles (or finds) the ``isa`` build of the kernels and loads it into torch.ops (once per
    process); returns what it did."""
    if isa in _BUILT:
        return "loaded"
    from torch.utils import cpp_extension

    unit, flags, folder, digest = _build_plan(isa)
    folder.mkdir(parents=True, exist_ok=True)
    cached = any(folder.glob("*.so"))
    source = folder / "kernels.cpp"
    if not source.is_file() or source.read_text() != unit:  # written only when it differs: ninja goes by its time
        partial = folder / f"kernels.cpp.{os.getpid()}"
        partial.write_text(unit)
        partial.replace(source)
    cpp_extension.load(
        name=f"tandem_kernels_{isa}_{digest}",
        sources=[str(source)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )
    _BUILT[isa] = "loaded" if cached else "built"
    return _BUILT[isa]


def _self_check(kernel: QuantKernel) -> str:
    """'' when the kernel matches the reference on every layout, row count and tile tail; else what differed."""
    generator = torch.Generator().manual_seed(0)
    int8 = kernel.activations == "int8"
    cases = [(8, 32, 0, torch.float16, False), (8, 16, 0, torch.float32, False), (4, 32, 8, torch.float16, False),
             (4, 32, 0, torch.float32, True), (5, 32, 16, torch.float16, False), (5, 32, 0, torch.float32, True)]
    for bits, group, zero, scale_dtype, with_mins in cases:
        out, width = (48, 128) if int8 else (37, 128)  # an odd number of rows: the float32 tiles' tails
        low, high = (-128, 128) if bits == 8 else (0, 2**bits)
        values = torch.randint(low, high, (out, width), generator=generator).numpy()
        weight = QuantizedTensor(
            torch.from_numpy(pack(values, bits)),
            (torch.rand(out, width // group, generator=generator) * 0.1).to(scale_dtype),
            torch.rand(out, width // group, generator=generator) if with_mins else None,
            group, bits, zero, "check",
        )
        weight_in_layout = kernel.prepare(weight)
        for rows in (1, 5, MAX_ROWS + 3):
            x = torch.randn(rows, width, generator=generator)
            got = kernel.matmul(x, weight_in_layout)
            if int8:
                want = reference.qmatmul_int8_activations(x, weight)
            else:
                want = reference.qmatmul(x, weight.packed, weight.scale, weight.mins, group, bits, zero, out)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                return f"bits {bits}, group {group}, {rows} rows: max difference {float((got - want).abs().max()):.3g}"
            if not torch.equal(kernel.matmul(x[-1:].contiguous(), weight_in_layout)[0], got[-1]):
                return f"bits {bits}, {rows} rows: a row's result depends on the rows beside it"
    return ""
