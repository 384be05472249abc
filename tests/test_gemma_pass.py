"""Gemma 3's ragged pass without the module tree (target_service/gemma_pass.py) and its native ops
(tandem/quant/decoder_ops.cpp): each op against its PyTorch reference on every build this host runs,
the references against transformers' Gemma 3 modules, the pass against the module tree, and the
invariant that a pass scores each row exactly as a one-token step does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, apply_rotary_pos_emb

from tandem.quant import reference
from tandem.quant.checkpoint import BLOCKS_FILE, quantize_model
from tandem.quant.native import QuantKernel, load_decoder_ops, load_kernel, runs_here
from target_service import gemma_pass, kv_cache, ragged
from target_service.engine import TargetEngine

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not runs_here(isa), reason=f"this CPU lacks {isa}"))
        for isa in ("avx2", "avx2int8", "avx512", "avx512vnni")]
EPS = 1e-6
RAGGED_ALONE = ragged.RaggedCache.alone


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=ISAS)
def ops(request):
    return load_decoder_ops(request.param)


@pytest.mark.parametrize("width", [640, 37])
def test_norms_match_their_references_and_each_row_is_alone(ops, width: int) -> None:
    x, y, w, v = _randn(5, width, seed=1), _randn(5, width, seed=2), _randn(width, seed=3), _randn(width, seed=4)
    got = ops.rms_norm(x, w, EPS)
    torch.testing.assert_close(got, reference.rms_norm(x, w, EPS), rtol=1e-6, atol=1e-6)
    hidden, normed = ops.add_rms_norm(x, y, w, v, EPS)
    want_hidden, want_normed = reference.add_rms_norm(x, y, w, v, EPS)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(normed, want_normed, rtol=1e-5, atol=1e-5)
    for row in range(5):  # bit for bit the same alone
        assert torch.equal(ops.rms_norm(x[row : row + 1].clone(), w, EPS)[0], got[row])
        alone = ops.add_rms_norm(x[row : row + 1].clone(), y[row : row + 1].clone(), w, v, EPS)
        assert torch.equal(alone[0][0], hidden[row]) and torch.equal(alone[1][0], normed[row])


def test_head_norm_rope_reads_a_slice_of_a_joined_product(ops) -> None:
    rows, heads, dim = 4, 3, 32
    joined = _randn(rows, heads * dim + dim, seed=5)  # [rows, q | k]: q is a strided view
    q = joined[:, : heads * dim].view(rows, heads, dim)
    w, angles = _randn(dim, seed=6), _randn(rows, dim, seed=7)
    got = ops.head_norm_rope(q, w, angles.cos(), angles.sin(), EPS)
    want = reference.head_norm_rope(q, w, angles.cos(), angles.sin(), EPS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = ops.head_norm_rope(q[1:2].contiguous(), w, angles[1:2].cos(), angles[1:2].sin(), EPS)
    assert torch.equal(alone[0], got[1])


@pytest.mark.parametrize("width", [2048, 37])
def test_gated_activation_matches_its_reference_in_the_body_and_the_tail(ops, width: int) -> None:
    joined = _randn(3, 2 * width, seed=8) * 4  # [rows, gate | up], both strided views
    gate, up = joined[:, :width], joined[:, width:]
    got = ops.gelu_tanh_mul(gate, up)
    torch.testing.assert_close(got, reference.gelu_tanh_mul(gate, up), rtol=1e-5, atol=1e-6)
    assert torch.equal(ops.gelu_tanh_mul(gate[2:].contiguous(), up[2:].contiguous())[0], got[2])
    extreme = torch.tensor([[-1e4, -30.0, 0.0, 30.0, 1e4]])
    torch.testing.assert_close(ops.gelu_tanh_mul(extreme, torch.ones_like(extreme)),
                               torch.nn.functional.gelu(extreme, approximate="tanh"))


@pytest.mark.parametrize("width", [262144, 37, 1])
def test_argmax_rows_is_torch_argmax_ties_nan_and_tails_included(ops, width: int) -> None:
    x = _randn(4, width, seed=15)
    cases = [x, x.round()]  # rounded: many rows of equal maxima, the first must win
    edge = torch.full((4, width), float("-inf"))
    edge[1, width // 2] = float("nan")  # a NaN counts as the largest
    edge[2, -1] = float("nan")
    edge[3, :] = 7.0  # all equal: index 0
    cases.append(edge)
    if width > 1:
        tied = x.clone()
        tied[:, -1] = tied[:, :-1].amax(dim=1) + 1  # the maximum in the tail (past the last full vector)
        tied[:, width // 3] = tied[:, -1]  # ... and tied earlier: the earlier one wins
        cases.append(tied)
    for case in cases:
        assert ops.argmax_rows(case).tolist() == case.argmax(dim=1).tolist()
        assert reference.argmax_rows(case).tolist() == case.argmax(dim=1).tolist()
    joined = _randn(3, 2 * width, seed=16)  # rows of a strided view
    assert ops.argmax_rows(joined[:, :width]).tolist() == joined[:, :width].argmax(dim=1).tolist()


@pytest.mark.parametrize("width", [262144, 37, 1])
def test_mask_rows_is_xgrammars_bitmask_applied(ops, width: int) -> None:
    import xgrammar

    x = _randn(5, width, seed=17)
    words = (width + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (5, words), generator=torch.Generator().manual_seed(18), dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[1], bitmask[2] = -1, 0  # a row all allowed, a row all forbidden (words taken whole)
    bitmask[3, ::2] = -1
    want = x.clone()
    xgrammar.apply_token_bitmask_inplace(want, bitmask, vocab_size=width)
    assert torch.equal(ops.mask_rows(x, bitmask), want)
    assert torch.equal(reference.mask_rows(x, bitmask), want)
    joined = _randn(5, 2 * width, seed=19)  # rows of a strided view
    want = joined[:, :width].clone()
    xgrammar.apply_token_bitmask_inplace(want, bitmask, vocab_size=width)
    assert torch.equal(ops.mask_rows(joined[:, :width], bitmask), want)


def test_ops_refuse_malformed_arguments(ops) -> None:
    with pytest.raises(RuntimeError, match="640 columns"):
        ops.rms_norm(_randn(2, 64), _randn(640), EPS)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.gelu_tanh_mul(_randn(2, 8), _randn(2, 9))
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.head_norm_rope(_randn(2, 3, 31), _randn(31), _randn(2, 31), _randn(2, 31), EPS)
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(_randn(2, 8).double())
    with pytest.raises(RuntimeError, match="ceil"):
        ops.mask_rows(_randn(2, 64), torch.zeros(2, 3, dtype=torch.int32))


def test_references_compute_what_transformers_gemma_modules_do() -> None:
    norm = Gemma3RMSNorm(64, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(_randn(64, seed=9))
    x = _randn(3, 64, seed=10)
    applied = 1.0 + norm.weight.detach()
    torch.testing.assert_close(reference.rms_norm(x, applied, EPS), norm(x), rtol=1e-6, atol=1e-6)

    rows, heads, dim = 3, 2, 64
    q = _randn(rows, heads, dim, seed=11)
    angles = torch.cat([_randn(rows, dim // 2, seed=12)] * 2, dim=-1)  # [rows, dim]: HF's cat(freqs, freqs)
    cos, sin = angles.cos(), angles.sin()
    want, _ = apply_rotary_pos_emb(norm_rows(q, applied), norm_rows(q, applied), cos[None], sin[None])
    torch.testing.assert_close(reference.head_norm_rope(q, applied, cos, sin, EPS), want[0].transpose(0, 1),
                               rtol=1e-5, atol=1e-5)
    gate, up = _randn(3, 50, seed=13), _randn(3, 50, seed=14)
    torch.testing.assert_close(reference.gelu_tanh_mul(gate, up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


def norm_rows(q: torch.Tensor, applied: torch.Tensor) -> torch.Tensor:
    """q [rows, heads, dim] through a Gemma 3 norm, as [1, heads, rows, dim] (transformers' layout)."""
    norm = Gemma3RMSNorm(q.shape[-1], eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(applied - 1.0)
    return norm(q).transpose(0, 1)[None]


def _quantized(tiny_gguf_gemma, tmp_path: Path, isa: str):
    hf_dir, gguf_path = tiny_gguf_gemma
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    kernel = QuantKernel(isa) if isa.startswith("reference") else load_kernel(isa)
    quantize_model(model, gguf_path, tmp_path / BLOCKS_FILE, kernel)
    ragged.install(model)
    return model


def _caches(model, prompts: list[list[int]]) -> list:
    caches = [kv_cache.new_cache() for _ in prompts]
    with torch.inference_mode():
        ragged.forward(model, caches, prompts, "cpu")
    return caches


def _without_pass(model):
    model.__dict__[gemma_pass._ATTRIBUTE] = None  # the module tree from here on
    return model


def test_the_pass_computes_what_the_module_tree_computes(tiny_gguf_gemma, tmp_path) -> None:
    """Float32 activations (the reference kernel): the pass and the module tree agree to rounding,
    for two sessions in one pass (one a token tree, past the sliding window of 8), logits and hidden states."""
    model = _quantized(tiny_gguf_gemma, tmp_path, "reference")
    assert gemma_pass.for_model(model) is not None
    prompts = [list(range(3, 15)), list(range(40, 47))]
    new = [[5, 6, 7], [8, 9, 10, 11]]
    trees = [None, (-1, 0, 0, 1)]
    results = []
    for lean in (True, False):
        if not lean:
            _without_pass(model)
        caches = _caches(model, prompts)
        with torch.inference_mode():
            results.append(ragged.forward(model, caches, new, "cpu", want_hidden=True, trees=trees,
                                          last_only=[False, False]))
    (lean_logits, lean_hidden), (tree_logits, tree_hidden) = results
    for a, b in zip(lean_logits + lean_hidden, tree_logits + tree_hidden):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ops_kind", ["native", "reference"])
@pytest.mark.parametrize("isa", [ISAS[0], ISAS[2]])  # float32 and int8 activations
def test_a_pass_scores_every_row_as_a_one_token_step_does(tiny_gguf_gemma, tmp_path, monkeypatch, isa: str,
                                                          ops_kind: str) -> None:
    """Bit for bit, with either kind of activations and the native ops or their references: the
    invariant that keeps speculation lossless (the products' kernels are row-exact by their own tests)."""
    if ops_kind == "reference":
        monkeypatch.setattr(gemma_pass, "_decoder_ops", lambda isa: reference)
    model = _quantized(tiny_gguf_gemma, tmp_path, isa)
    assert gemma_pass.for_model(model).ops is (reference if ops_kind == "reference" else load_decoder_ops(isa))
    prompt = list(range(3, 16))
    new = [21, 22, 23, 24, 25]
    (cache,) = _caches(model, [prompt])
    with torch.inference_mode():
        (together,), _ = ragged.forward(model, [cache], [new], "cpu", row_exact=True)
        kv_cache.truncate(cache, len(prompt))
        alone = torch.cat([ragged.forward(model, [cache], [[token]], "cpu", row_exact=True)[0][0] for token in new])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("tree", [None, (-1, 0, 0, 1, 3)])
@pytest.mark.parametrize("isa", [ISAS[1], ISAS[3]])  # the int8 builds: a target's default on AVX2 and VNNI
def test_a_lone_session_writes_and_attends_its_cache_directly_as_the_general_path_does(
        tiny_gguf_gemma, tmp_path, monkeypatch, isa: str, tree) -> None:
    """``RaggedCache.alone`` (one session, row by row, the native attention reading the cache's whole
    buffers) gives bit for bit the logits, hidden states and cache of the per-layer ``update`` and
    installed attention, for a chain and a token tree past the sliding window of 8, with two kv heads
    (whose cache views are not contiguous)."""
    model = _quantized(tiny_gguf_gemma, tmp_path, isa)
    assert model.config.num_key_value_heads == 2
    direct = _lone_pass(model, tree, monkeypatch, direct=True)
    general = _lone_pass(model, tree, monkeypatch, direct=False)
    for got, want in zip(direct, general, strict=True):
        assert torch.equal(got, want)


def _lone_pass(model, tree, monkeypatch, direct: bool) -> list[torch.Tensor]:
    """Five new tokens after a 13-token prompt, one session row by row, with or without
    ``RaggedCache.alone``: [logits, hidden states, then each layer's keys and values]."""
    real = RAGGED_ALONE
    used = []

    def alone(self, head_dim):
        used.append(real(self, head_dim) if direct else None)
        return used[-1]

    monkeypatch.setattr(ragged.RaggedCache, "alone", alone)
    (cache,) = _caches(model, [list(range(3, 16))])
    with torch.inference_mode():
        (logits,), (hidden,) = ragged.forward(model, [cache], [[21, 22, 23, 24, 25]], "cpu", want_hidden=True,
                                              trees=[tree], row_exact=True)
    assert (used[-1] is not None) == direct
    return [logits, hidden, *(t.clone() for layer in cache.layers for t in (layer.keys, layer.values))]


@pytest.mark.parametrize("isa", [ISAS[1], ISAS[3]])  # the int8 builds, the only ones with the native layer
def test_the_native_decoder_layer_computes_what_the_calls_one_by_one_do(tiny_gguf_gemma, tmp_path, isa) -> None:
    """``decoder_layer.cpp`` (a whole layer in one call, the cache written in place) against the same
    ops called one by one from Python, bit for bit: logits, hidden states and every layer's keys and
    values, through a prompt, a token tree, chains, a cache that must grow (past its spare room) and
    passes past the sliding window of 8, a truncation and the steps after it. A session's first pass
    (nothing in its cache yet) goes through the calls."""
    model = _quantized(tiny_gguf_gemma, tmp_path, isa)
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():  # norms of their own (the tiny model's are all alike), so none can stand in for another
        for module in model.modules():
            if isinstance(module, Gemma3RMSNorm):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.3)
    lean = gemma_pass.for_model(model)
    native = lean.native_layer
    assert native is not None
    assert any(len(layer.qkv.weights) + len(layer.gate_up.weights) > 2 for layer in lean.layers)  # joined runs
    calls = []
    lean.native_layer = lambda *args: calls.append(1) or native(*args)
    steps = [[5, 6, 7, 8, 9], [11], [12, 13], *[[30 + i] for i in range(kv_cache.SPARE_POSITIONS + 4)]]
    results = []
    for use_native in (True, False):
        lean.native_layer = (lambda *args: calls.append(1) or native(*args)) if use_native else None
        calls.clear()
        (cache,) = _caches(model, [list(range(3, 16))])
        assert not calls  # the prompt: the cache had no layers to write in place
        outputs = []
        with torch.inference_mode():
            for step in steps:
                tree = [(-1, 0, 0, 1, 3)] if len(step) == 5 else [None]
                (logits,), (hidden,) = ragged.forward(model, [cache], [step], "cpu", want_hidden=True, trees=tree,
                                                      row_exact=True)
                outputs += [logits, hidden]
            kv_cache.truncate(cache, 20)
            (logits,), _ = ragged.forward(model, [cache], [[7, 8, 9]], "cpu", row_exact=True)
        outputs.append(logits)
        assert len(calls) == (len(steps) + 1) * len(lean.layers) if use_native else not calls
        results.append([*outputs, *(t.clone() for layer in cache.layers for t in (layer.keys, layer.values))])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    layer = cache.layers[0]
    keys, values = layer.buffers
    full = keys.shape[2]
    with pytest.raises(RuntimeError, match="no room"):  # a caller that did not reserve is refused, nothing written
        normed = torch.zeros(1, model.config.hidden_size)
        native(normed, normed, torch.ones(1, lean.head_dim), torch.zeros(1, lean.head_dim), *lean.layer_arguments[0],
               keys, values, full, *ragged._row_ranges(full - 1, 1, None, None), lean.heads, lean.kv_heads,
               lean.head_dim, 1e-6, 1.0, 0.0)


def test_only_a_gemma_on_quantized_weights_throughout_gets_the_pass(tiny_gguf_gemma, tmp_path) -> None:
    hf_dir, _ = tiny_gguf_gemma
    float_model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert gemma_pass.for_model(float_model) is None
    model = _quantized(tiny_gguf_gemma, tmp_path, "reference")
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(8, 8)  # one product kept in float32
    assert gemma_pass.for_model(model) is None


def test_the_engine_routes_short_steps_through_the_pass(tiny_gguf_gemma, tmp_path, monkeypatch) -> None:
    from tandem import models
    from target_service.session import SessionConfig

    hf_dir, _ = tiny_gguf_gemma
    model = _quantized(tiny_gguf_gemma, tmp_path, "reference")
    engine = TargetEngine(models.LoadedModel("tiny-q", model, models.load_tokenizer(str(hf_dir)), hf_dir, "float32",
                                             "cpu", "quantized:test"))
    assert engine.runner.lean and not engine.runner.row_exact
    calls = []
    real = gemma_pass.GemmaPass.run
    monkeypatch.setattr(gemma_pass.GemmaPass, "run",
                        lambda self, *args: calls.append(len(args[2])) or real(self, *args))
    engine.prefill("s", list(range(3, 40)), SessionConfig(max_new_tokens=3, ignore_eos=True))
    engine.generate("s", 2)
    assert calls[-2:] == [1, 1]  # each decode step: one row through the pass


@pytest.mark.parametrize("isa", [ISAS[1], ISAS[3]])  # AVX2 and AVX-512 builds of the native argmax
def test_greedy_rows_take_the_native_argmax_and_decode_as_the_logits_say(tiny_gguf_gemma, tmp_path, isa) -> None:
    """A greedy step's rows come back as their argmax: from the quantized head in waves
    (``target_service.greedy_waves``) by default, else (``screened_head=False``) as decoder_ops'
    argmax_rows over the logits; decoding and verification give the tokens the (soft-capped)
    logits' own argmax gives, whichever way."""
    from tandem import models
    from target_service.greedy_waves import GreedyWaves
    from target_service.runner import RowScores
    from target_service.session import SessionConfig
    from target_service.types import DraftBlock

    hf_dir, _ = tiny_gguf_gemma
    model = _quantized(tiny_gguf_gemma, tmp_path, isa)
    gemma_pass.for_model(model).softcap = 0.5  # a final logit soft-cap that bites, shared by every way
    engines = []
    for way in ("waves", "native", "verifier"):
        engine = TargetEngine(models.LoadedModel("tiny-q", model, models.load_tokenizer(str(hf_dir)), hf_dir,
                                                 "float32", "cpu", "quantized:test"), screened_head=way == "waves")
        assert engine.runner.argmax_rows == load_decoder_ops(isa).argmax_rows
        assert isinstance(engine.runner.greedy_head, GreedyWaves) == (way == "waves")
        if way == "verifier":
            engine.runner.argmax_rows = None  # the verifier's argmax over the logits instead
        engines.append(engine)
    engines[0].runner.greedy_head.sweep_rows = 2  # waves of two rows, whatever this build's sweep
    seen: dict[int, list[RowScores]] = {0: [], 1: []}
    for i in seen:
        real = engines[i].runner._score
        engines[i].runner._score = lambda steps, outputs, i=i, real=real: [
            seen[i].append(s) or (s, h) for s, h in real(steps, outputs)]
    outputs = []
    for engine in engines:
        engine.prefill("s", list(range(3, 30)), SessionConfig(max_new_tokens=40, ignore_eos=True))
        generated = engine.generate("s", 6).token_ids
        committed = len(engine.store.get("s").tokens)
        verdict = engine.verify(DraftBlock("s", committed, tuple([*generated[:2], (generated[2] + 1) % 50, 7, 7, 7])))
        outputs.append((generated, verdict.num_accepted, verdict.committed_token_ids))
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0][1] == 2
    # The waves (rows 0-1, then 2-3) scored no row past the rejected third draft; the native argmax
    # came with the logits it was taken from (a session's log-probabilities read them).
    assert all(s.argmax is not None and s.logits is None for s in seen[0])
    assert seen[0][-1].argmax.tolist()[:3] == [*generated[:2], verdict.committed_token_ids[-1]]
    assert seen[0][-1].argmax.tolist()[4:] == [-1, -1, -1]
    assert any(s.argmax is not None and s.logits is not None for s in seen[1])


@pytest.mark.parametrize("isa", [ISAS[1], ISAS[3]])  # int8 activations: the row-exact runner
def test_a_prompt_fills_the_cache_alike_alone_and_beside_other_sessions(tiny_gguf_gemma, tmp_path, isa) -> None:
    """A 30-token prompt (past the sliding window of 8, and longer than a short step) prefilled
    alone, and prefilled in one pass with another session's decode step: the same first token,
    the cache bit for bit, and the same greedy tokens after it. Through the module tree alone and
    the ragged path beside others, int8 activations made a greedy answer depend on the load."""
    from tandem import models
    from target_service.planner import DecodeStep
    from target_service.session import SessionConfig

    hf_dir, _ = tiny_gguf_gemma
    model = _quantized(tiny_gguf_gemma, tmp_path, isa)
    loaded = models.LoadedModel("tiny-q", model, models.load_tokenizer(str(hf_dir)), hf_dir, "float32", "cpu",
                                "quantized:test")
    alone, beside = TargetEngine(loaded), TargetEngine(loaded)
    assert alone.runner.row_exact
    prompt = [3 + (7 * i) % 200 for i in range(30)]
    config = SessionConfig(max_new_tokens=12, ignore_eos=True)
    first_alone = alone.prefill("p", prompt, config)
    beside.prefill("other", list(range(50, 60)), config)
    job = beside.begin_prefill("p", prompt, config)
    answers = beside.run_batch([job, DecodeStep("other")])
    while answers[0] is None:  # the prompt in chunks (one here: the default chunk holds it)
        answers = beside.run_batch([job])
    assert answers[0].token_id == first_alone.token_id
    for want, got in zip(alone.store.get("p").cache.layers, beside.store.get("p").cache.layers, strict=True):
        assert torch.equal(got.keys[..., : len(prompt), :], want.keys[..., : len(prompt), :])
        assert torch.equal(got.values[..., : len(prompt), :], want.values[..., : len(prompt), :])
    assert beside.generate("p", 8).token_ids == alone.generate("p", 8).token_ids
