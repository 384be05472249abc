"""Gemma 3's ragged pass written straight onto the weights, for a target on a GGUF file's blocks.

On a CPU a small model's decode step is short enough that transformers' module tree spends nearly
as long again in Python: hundreds of small tensor operations per pass (a norm alone is eight),
each paying PyTorch's dispatch (figures: docs/target.md#quantized-cpu-kernels). This pass makes the same computation in about
fifteen calls per layer: the products go straight to the quantized kernel, and each norm, the
query/key norm with its rotary embedding, and the gated activation are one native call each
(``tandem.quant.decoder_ops.cpp``; their PyTorch references where it is not built). For a lone
session on the int8 kernels a layer is a single native call (``tandem.quant.decoder_layer.cpp``),
the same kernels and ops in the same order, so the same bits; the Python between the calls cost
about a tenth of a gemma-3-270m decode step (figures: benchmarks/RESULTS.md, session 50).

It runs inside :func:`target_service.ragged.forward`, with the same :class:`RaggedCache` and the
same attention function the module tree would call, so the caches, token trees, the sliding window
and row-exact attention behave exactly as there. Invariant: each row's output depends only on
that row and its session's cache (the ops and kernels fix every row's order of operations, and a
position's rotary values are computed once per process), so a verification pass scores a position
with exactly the logits a one-token step gives it. Against the module tree it differs only by
float32 rounding (the norms sum their squares in float64).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from tandem.quant import reference
from tandem.quant.modules import QuantEmbedding, QuantLinear, bound_product
from tandem.quant.native import tiles_op
from tandem.quant.tensor import QuantizedTensor, stack, stackable

log = logging.getLogger(__name__)

ROPE_CHUNK = 1024  # positions the rotary tables grow by
_ATTRIBUTE = "_tandem_gemma_pass"


class _Products:
    """The products of one input with several weights (q, k, v; gate, up), each run of weights of
    one format joined into one kernel call (``tandem.quant.tensor.stack``: the same bits per row),
    the call bound once (``bound_product``)."""

    def __init__(self, *modules: QuantLinear) -> None:
        runs: list[tuple[QuantizedTensor, list[int]]] = []  # (joined weight, each module's out_features)
        for module in modules:
            weight = module.quantized
            if runs and stackable([runs[-1][0], weight]):
                joined, sizes = runs[-1]
                runs[-1] = (stack([joined, weight]), [*sizes, module.out_features])
            else:
                runs.append((weight, [module.out_features]))
        self.runs = [(bound_product(modules[0].kernel, weight), sizes) for weight, sizes in runs]
        self.biases = [module.bias for module in modules]
        self.kernel = modules[0].kernel
        self.weights = [weight for weight, _ in runs]

    def native_arguments(self) -> list[tuple] | None:
        """Each run's (packed, scale, mins, [group, bits, zero, out_features]), as the native decoder
        layer takes a product, where that is what this call computes (no bias, every run on the int8
        tiles kernel); else None."""
        if any(bias is not None for bias in self.biases) or self.kernel.activations != "int8":
            return None
        if any(tiles_op(self.kernel, weight) is None for weight in self.weights):
            return None
        return [(w.packed, w.scale, w.mins, [w.group, w.bits, w.zero, w.shape[0]]) for w in self.weights]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [rows, in] float32 contiguous -> each module's [rows, out_i] (views of a joined run's output)."""
        outputs = []
        for call, sizes in self.runs:
            out = call(x)  # [rows, sum(sizes)]
            outputs.extend(out.split(sizes, dim=1) if len(sizes) > 1 else (out,))
        return [out if bias is None else out + bias for out, bias in zip(outputs, self.biases)]


@dataclass(frozen=True)
class _Layer:
    attention: nn.Module  # the module tree's attention: what the attention function is handed
    qkv: _Products
    o: _Products
    gate_up: _Products
    down: _Products
    q_norm: torch.Tensor  # [head_dim] each norm's weight as applied: 1 + w
    k_norm: torch.Tensor
    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor
    rope: str  # the layer type whose rotary table it reads
    window: int | None


class _Rope:
    """cos/sin tables [positions, head_dim] of one layer type, grown by whole chunks: every position's
    values are computed once, so no pass can see them rounded differently from another."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float) -> None:
        self.inv_freq = inv_freq.float()  # [head_dim / 2]
        self.scaling = scaling
        self.cos = torch.empty(0, 2 * len(inv_freq))
        self.sin = torch.empty(0, 2 * len(inv_freq))

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # positions [rows]
        end = int(positions.max()) + 1
        while self.cos.shape[0] < end:
            start = self.cos.shape[0]
            freqs = torch.arange(start, start + ROPE_CHUNK).float()[:, None] * self.inv_freq  # [chunk, head_dim / 2]
            angles = torch.cat([freqs, freqs], dim=-1)  # [chunk, head_dim]
            self.cos = torch.cat([self.cos, angles.cos() * self.scaling])
            self.sin = torch.cat([self.sin, angles.sin() * self.scaling])
        return self.cos[positions], self.sin[positions]  # [rows, head_dim] each


class GemmaPass:
    """A quantized Gemma 3 text model's forward over a ragged pass (see the module docstring)."""

    def __init__(self, model: nn.Module, ops) -> None:
        config = model.config.get_text_config()
        inner = model.model
        self.ops = ops
        self.eps = float(config.rms_norm_eps)
        self.heads, self.kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        self.head_dim = int(config.head_dim)
        self.embed = inner.embed_tokens
        self.lm_head = model.lm_head
        self.softcap = config.final_logit_softcapping
        self.final_norm = _applied(inner.norm)
        rotary = inner.rotary_emb
        self.ropes = {
            kind: _Rope(getattr(rotary, f"{kind}_inv_freq"), float(getattr(rotary, f"{kind}_attention_scaling")))
            for kind in set(config.layer_types)
        }
        self.layers = []
        for index, layer in enumerate(inner.layers[: config.num_hidden_layers]):
            attention, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                attention,
                _Products(attention.q_proj, attention.k_proj, attention.v_proj), _Products(attention.o_proj),
                _Products(mlp.gate_proj, mlp.up_proj), _Products(mlp.down_proj),
                _applied(attention.q_norm), _applied(attention.k_norm), _applied(layer.input_layernorm),
                _applied(layer.post_attention_layernorm), _applied(layer.pre_feedforward_layernorm),
                _applied(layer.post_feedforward_layernorm), config.layer_types[index], attention.sliding_window,
            ))
        self.attention_kwargs = {"scaling": float(self.layers[0].attention.scaling),
                                 "softcap": config.attn_logit_softcapping}
        # the whole layer in one call: the native ops fused, so only where they are native too
        self.native_layer, self.layer_arguments = (
            _native_layers(self.layers, self.final_norm) if ops is not reference else (None, [])
        )

    def run(self, attend, ragged, input_ids: torch.Tensor, positions: torch.Tensor, keep: int | torch.Tensor):
        """input_ids, positions [rows]; ``attend`` the attention function (ragged's, over ``ragged``);
        ``keep`` as transformers' ``logits_to_keep`` (0: every row, else row indices).
        Returns (final hidden states [rows, hidden] after the last norm, logits [kept rows, vocab])."""
        ops, eps = self.ops, self.eps
        rows = input_ids.shape[0]
        hidden = self.embed(input_ids).float().contiguous()  # [rows, hidden]
        tables = {kind: rope.at(positions) for kind, rope in self.ropes.items()}
        normed = ops.rms_norm(hidden, self.layers[0].input_norm, eps)
        alone = ragged.alone(self.head_dim)  # one session attending row by row: its cache written and read directly
        buffers = ragged.alone_buffers(len(self.layers)) if alone is not None and self.native_layer else None
        for index, layer in enumerate(self.layers):
            cos, sin = tables[layer.rope]
            if buffers is not None:  # the whole layer in one native call, writing the cache in place
                cached = buffers[index].reserve(rows)
                hidden, normed = self.native_layer(
                    hidden, normed, cos, sin, *self.layer_arguments[index], *buffers[index].buffers, cached,
                    *ragged.alone_ranges(cached, layer.window), self.heads, self.kv_heads, self.head_dim, eps,
                    self.attention_kwargs["scaling"], self.attention_kwargs["softcap"] or 0.0,
                )
                buffers[index].advance(rows)
                continue
            q, k, v = layer.qkv(normed)  # [rows, heads * head_dim], [rows, kv_heads * head_dim] x 2
            q = ops.head_norm_rope(q.view(rows, self.heads, self.head_dim), layer.q_norm, cos, sin, eps)
            k = ops.head_norm_rope(k.view(rows, self.kv_heads, self.head_dim), layer.k_norm, cos, sin, eps)
            v = v.view(rows, self.kv_heads, self.head_dim)
            if alone is not None:
                out = alone(index, q, k, v, layer.window, **self.attention_kwargs)  # [rows, heads * head_dim]
            else:
                keys, values = ragged.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], index)
                out, _ = attend(layer.attention, q.transpose(0, 1)[None], keys, values, ragged.marker,
                                sliding_window=layer.window, **self.attention_kwargs)  # [1, rows, heads, head_dim]
                out = out.reshape(rows, self.heads * self.head_dim).contiguous()
            (attended,) = layer.o(out)  # [rows, hidden]
            hidden, normed = ops.add_rms_norm(hidden, attended, layer.post_attention_norm, layer.pre_feedforward_norm,
                                              eps)
            gated = ops.gelu_tanh_mul(*layer.gate_up(normed))  # [rows, intermediate]
            after = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            (down,) = layer.down(gated)
            hidden, normed = ops.add_rms_norm(hidden, down, layer.post_feedforward_norm, after, eps)
        scored = normed if isinstance(keep, int) and keep == 0 else normed[keep]  # [kept, hidden]
        return normed, self.logits(scored)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head over final hidden states [rows, hidden] -> [rows, vocab], soft-capped as the
        model says; each row alone (the quantized head's rows do not depend on each other)."""
        logits = self.lm_head(normed)  # [rows, vocab]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def for_model(model: nn.Module) -> GemmaPass | None:
    """The model's :class:`GemmaPass` (built once), or None where the model is not a Gemma 3 text
    model on quantized weights throughout (then the module tree runs)."""
    if _ATTRIBUTE not in model.__dict__:
        model.__dict__[_ATTRIBUTE] = _build(model)
    return model.__dict__[_ATTRIBUTE]


def _build(model: nn.Module) -> GemmaPass | None:
    if type(model).__name__ != "Gemma3ForCausalLM":
        return None
    if not isinstance(getattr(model.model, "embed_tokens", None), QuantEmbedding):
        return None
    config = model.config.get_text_config()
    linears = [m for m in model.model.layers.modules() if isinstance(m, nn.Linear | QuantLinear)]
    if not linears or not all(isinstance(m, QuantLinear) for m in linears):
        return None
    rope_types = {kind: (config.rope_parameters or {}).get(kind, {}).get("rope_type", "default")
                  for kind in set(config.layer_types)}
    if any(kind not in ("default", "linear") for kind in rope_types.values()):  # dynamic kinds change with length
        log.info("module tree for the target pass: rope types %s", rope_types)
        return None
    if config.hidden_activation != "gelu_pytorch_tanh":
        return None
    return GemmaPass(model, _decoder_ops(linears[0].kernel.isa))


def _decoder_ops(isa: str):
    """decoder_ops.cpp built for ``isa``, else its PyTorch references (same semantics)."""
    from tandem.quant.native import ISA_FLAGS, KernelUnavailable, load_decoder_ops

    if isa in ISA_FLAGS:
        try:
            return load_decoder_ops(isa)
        except KernelUnavailable as error:
            log.warning("decoder ops in PyTorch: %s", error)
    return reference


def _native_layers(layers: list[_Layer], final_norm: torch.Tensor) -> tuple[object | None, list[tuple]]:
    """decoder_layer.cpp's op and each layer's arguments for it (packed, scale, mins, meta, runs, norms),
    where every product of every layer runs on int8 tiles and the op is built; else (None, [])."""
    from tandem.quant.native import KernelUnavailable, load_decoder_layer

    products = [[part.native_arguments() for part in (layer.qkv, layer.o, layer.gate_up, layer.down)]
                for layer in layers]
    if not layers or any(arguments is None for layer in products for arguments in layer):
        return None, []
    try:
        op = load_decoder_layer(layers[0].qkv.kernel.isa)
    except KernelUnavailable as error:
        log.warning("decoder layers call their ops one by one: %s", error)
        return None, []
    arguments = []
    for index, (layer, parts) in enumerate(zip(layers, products)):
        after = layers[index + 1].input_norm if index + 1 < len(layers) else final_norm
        norms = [layer.q_norm, layer.k_norm, layer.post_attention_norm, layer.pre_feedforward_norm,
                 layer.post_feedforward_norm, after]
        runs = [run for part in parts for run in part]
        arguments.append(([run[0] for run in runs], [run[1] for run in runs], [run[2] for run in runs],
                          [value for run in runs for value in run[3]], [len(part) for part in parts], norms))
    return op, arguments


def _applied(norm: nn.Module) -> torch.Tensor:
    """A Gemma norm's weight as it multiplies: 1 + w, float32 [dim]."""
    return (1.0 + norm.weight.detach().float()).contiguous()
