"""The quantized CPU kernel (tandem/quant/qmatmul.cpp) against its PyTorch reference, on every build
this host can run, and the probe that picks the build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.quant import native, reference
from tandem.quant.native import KernelUnavailable, cpu_flags, load_kernel, probe
from tandem.quant.tensor import TILES, QuantizedTensor, pack, stack, stackable

FLAGS = cpu_flags()
NEEDS = native.CPU_FLAGS_NEEDED
ISAS = [
    pytest.param(isa, marks=pytest.mark.skipif(not needs <= FLAGS, reason=f"this CPU lacks {sorted(needs - FLAGS)}"))
    for isa, needs in NEEDS.items()
]
# (bits, group, zero, scale dtype, with minimums): the layouts of every GGUF type tandem reads.
LAYOUTS = [
    (8, 32, 0, torch.float16, False),  # Q8_0
    (8, 16, 0, torch.float32, False),  # Q6_K
    (4, 32, 8, torch.float16, False),  # Q4_0
    (4, 32, 0, torch.float32, True),  # Q4_K, Q4_1
    (5, 32, 16, torch.float16, False),  # Q5_0
    (5, 32, 0, torch.float32, True),  # Q5_K, Q5_1
]


def _weight(bits: int, group: int, zero: int, scale_dtype: torch.dtype, with_mins: bool, out: int, width: int,
            seed: int = 0) -> QuantizedTensor:
    rng = np.random.default_rng(seed)
    low, high = (-128, 128) if bits == 8 else (0, 2**bits)
    generator = torch.Generator().manual_seed(seed)
    return QuantizedTensor(
        torch.from_numpy(pack(rng.integers(low, high, (out, width)), bits)),
        (torch.rand(out, width // group, generator=generator) * 0.05).to(scale_dtype),
        torch.rand(out, width // group, generator=generator) * 0.1 if with_mins else None,
        group, bits, zero, "test",
    )


@pytest.fixture(scope="module", params=ISAS)
def kernel(request) -> native.QuantKernel:
    return load_kernel(request.param)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout[0]}bit-g{layout[1]}-z{layout[2]}")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 17])
def test_kernel_matches_reference(kernel, layout, rows: int) -> None:
    out = 48 if kernel.activations == "int8" else 45  # 45 output rows: the two-row tiles' tail too
    weight = _weight(*layout, out=out, width=256)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    prepared = kernel.prepare(weight)
    got = kernel.matmul(x, prepared)
    if kernel.activations == "int8":
        assert prepared.layout == TILES
        want = reference.qmatmul_int8_activations(x, weight)
    else:
        want = reference.qmatmul(x, weight.packed, weight.scale, weight.mins, weight.group, weight.bits, weight.zero,
                                 out)
    assert got.shape == (rows, out)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # summation order (and float64) only


INT8_ISAS = [param for param in ISAS if param.values[0] in native.INT8_ISAS]


@pytest.mark.parametrize("isa", INT8_ISAS)
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_int8_products_stay_exact_at_the_extremes(isa: str, bits: int) -> None:
    """The largest integers of each width times full-scale activations of either sign: where a build
    sums byte products in 16 bits first (avx2int8), no sum saturates."""
    kernel = load_kernel(isa)
    out, width = 32, 256
    extremes = [-128, 127] if bits == 8 else [2**bits - 1]
    for value in extremes:
        weight = QuantizedTensor(torch.from_numpy(pack(np.full((out, width), value), bits)),
                                 torch.full((out, width // 32), 0.01), None, 32, bits, 0, "test")
        for sign in (1.0, -1.0):
            x = torch.full((3, width), sign)
            x[1, ::2] = -sign  # alternating signs in one row
            got = kernel.matmul(x, kernel.prepare(weight))
            torch.testing.assert_close(got, reference.qmatmul_int8_activations(x, weight), rtol=1e-5, atol=1e-4)


def test_int8_activations_are_close_to_float32_ones() -> None:
    """The int8 kernel's semantics (its reference) stay within llama.cpp-like error of the exact product."""
    weight = _weight(8, 32, 0, torch.float16, False, out=64, width=512, seed=3)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(3))
    exact = reference.qmatmul(x, weight.packed, weight.scale, weight.mins, 32, 8, 0, 64)
    approximate = reference.qmatmul_int8_activations(x, weight)
    assert float((approximate - exact).norm() / exact.norm()) < 0.01


@pytest.mark.parametrize("layout", LAYOUTS[:1] + LAYOUTS[4:5], ids=["8bit", "5bit"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel, layout) -> None:
    """Bit for bit: a verification pass's row gets the autoregressive step's logits."""
    weight = kernel.prepare(_weight(*layout, out=64, width=128, seed=1))
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(7))
    together = kernel.matmul(x, weight)
    for i in range(12):
        assert torch.equal(kernel.matmul(x[i : i + 1].contiguous(), weight)[0], together[i])
    assert torch.equal(kernel.matmul(x[3:8].contiguous(), weight), together[3:8])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout[0]}bit-g{layout[1]}-z{layout[2]}")
def test_stacked_weights_give_each_row_exactly_its_own_product(kernel, layout) -> None:
    """tandem.quant.tensor.stack: q|k|v or gate|up in one call, the same bits as one call per weight."""
    parts = [kernel.prepare(_weight(*layout, out=out, width=128, seed=seed)) for seed, out in enumerate((48, 16, 32))]
    joined = stack(parts)
    assert joined.shape == (96, 128) and joined.layout == parts[0].layout
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    assert torch.equal(kernel.matmul(x, joined), torch.cat([kernel.matmul(x, part) for part in parts], dim=1))


def test_only_weights_of_one_format_stack() -> None:
    a = _weight(8, 32, 0, torch.float16, False, out=16, width=64)
    b = _weight(5, 32, 16, torch.float16, False, out=16, width=64)
    assert stackable([a, a]) and not stackable([a, b])
    with pytest.raises(ValueError, match="one format"):
        stack([a, b])


def test_kernel_refuses_malformed_arguments(kernel) -> None:
    weight = kernel.prepare(_weight(8, 32, 0, torch.float16, False, out=16, width=64))
    with pytest.raises(RuntimeError, match="x must be"):
        kernel.matmul(torch.randn(2, 64, dtype=torch.float64), weight)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        kernel.matmul(torch.randn(2, 96), weight)


def test_the_build_is_cached_in_the_tandem_cache_one_folder_for_every_op(kernel) -> None:
    """The product kernel, the row attention and the decoder ops: one build (one translation unit)
    in one folder there, loaded once per process."""
    assert kernel.isa in NEEDS
    native.load_row_attention(kernel.isa)
    native.load_decoder_ops(kernel.isa)
    folder = native.build_folder(kernel.isa)
    assert folder.parent == native_cache() / "kernels" and len(list(folder.glob("*.so"))) == 1
    unit = (folder / "kernels.cpp").read_text()
    assert all(f"#define TANDEM_QUANT_LIBRARY {native._library(kernel.isa, kind)}" in unit
               for kind in ("", *native.OPS_KINDS))
    assert native._build(kernel.isa) == "loaded"


def test_prebuild_builds_only_what_the_probes_build_lacks(monkeypatch, tmp_path: Path) -> None:
    """What ``tandem serve`` runs beside a first conversion: the probe's build, only where its
    folder has no library yet; a failed build is left to the target."""
    monkeypatch.setattr(native, "probe", lambda: ("avx2int8", "forced"))
    monkeypatch.setattr(native, "build_folder", lambda isa: tmp_path / isa)
    built = []

    def fake_build(isa: str) -> str:
        if isa == "avx2":
            raise RuntimeError("no compiler")
        built.append(isa)
        return "built"

    monkeypatch.setattr(native, "_build", fake_build)
    assert native.prebuild() == ["avx2int8"] and built == ["avx2int8"]
    (tmp_path / "avx2int8").mkdir()
    (tmp_path / "avx2int8" / "lib.so").write_bytes(b"")
    assert native.prebuild() == [] and built == ["avx2int8"]  # built already
    monkeypatch.setattr(native, "probe", lambda: ("avx2", "forced"))
    assert native.prebuild() == []  # the build failed: the target will say why
    monkeypatch.setattr(native, "probe", lambda: (None, "no AVX2"))
    assert native.prebuild() == []


def native_cache() -> Path:
    from tandem.models import cache_dir

    return cache_dir()


VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


@pytest.mark.parametrize(
    ("capability", "flags", "env", "want"),
    [
        ("AVX512", VNNI, None, "avx512vnni"),
        ("AVX512", {"avx512f", "avx512bw"}, None, "avx512"),
        ("AVX512_BF16", set(), None, "avx512"),
        ("AVX2", VNNI, None, "avx2int8"),  # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 host: an AVX2 build
        ("AVX2", {"avx2", "fma", "f16c"}, None, "avx2int8"),  # an AVX2-only CPU: int8 activations too
        ("AVX2", set(), "avx2", "avx2"),  # float32 activations on AVX2, asked for
        ("DEFAULT", set(), None, None),
        ("AVX512", VNNI, "avx2", "avx2"),
        ("AVX512", VNNI, "avx512", "avx512"),
        ("AVX2", set(), "none", None),
        ("DEFAULT", set(), "avx512vnni", "avx512vnni"),
    ],
)
def test_probe_follows_the_cpu_capability_and_the_override(monkeypatch, capability, flags, env, want) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    if env is None:
        monkeypatch.delenv(native.ENV, raising=False)
    else:
        monkeypatch.setenv(native.ENV, env)
    isa, why = probe()
    assert isa == want and why


def test_probe_refuses_an_unknown_override(monkeypatch) -> None:
    monkeypatch.setenv(native.ENV, "sse9")
    with pytest.raises(ValueError, match="must be auto, avx512vnni, avx512, avx2int8, avx2 or none"):
        probe()


def test_no_build_for_this_host_says_why(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.delenv(native.ENV, raising=False)
    with pytest.raises(KernelUnavailable, match="CPU capability DEFAULT"):
        load_kernel()


def test_a_build_this_cpu_cannot_run_is_refused_before_it_runs(monkeypatch) -> None:
    """On an AVX2-only CPU the AVX-512 builds are refused by name (running one would end the process
    with SIGILL), and the list of what this host runs leaves them out."""
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "f16c", "sse2"})
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.setattr(native, "_BUILT", {})
    built = []
    monkeypatch.setattr(native, "_build", lambda isa: built.append(isa) or "built")
    monkeypatch.setattr(native, "_self_check", lambda kernel: "")
    for isa in ("avx512vnni", "avx512"):
        with pytest.raises(KernelUnavailable, match=f"the {isa} build needs CPU flags this CPU lacks: .*avx512bw, avx512f"):
            load_kernel(isa)
        with pytest.raises(KernelUnavailable, match="lacks"):
            native.load_decoder_ops(isa)
    assert built == []
    assert native.available_kernels() == ["avx2int8", "avx2"]


def test_a_failed_build_says_why(monkeypatch) -> None:
    def no_compiler(isa: str) -> str:
        raise OSError("g++: not found")

    monkeypatch.setattr(native, "_build", no_compiler)
    monkeypatch.setattr(native, "_LOADED", {})
    with pytest.raises(KernelUnavailable, match="g\\+\\+: not found"):
        load_kernel("avx2")


def test_a_build_that_disagrees_with_its_reference_is_not_used(monkeypatch) -> None:
    monkeypatch.setattr(native, "_build", lambda isa: "built")
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.setattr(native.QuantKernel, "matmul", lambda self, x, weight: torch.zeros(x.shape[0], weight.shape[0]))
    with pytest.raises(KernelUnavailable, match="disagrees with its reference"):
        load_kernel("avx2")
