"""One forward pass over several sessions: each with its own KV cache, length and new tokens.

Decoding is bound by reading the weights, not by arithmetic: one token of each of several sessions
in one pass costs little more than one token alone, so when several sessions wait for the target,
running their steps together multiplies throughput (the continuous batching of vLLM and TGI,
without their paged caches; figures: docs/target.md#continuous-batching).

The sessions' tokens are laid end to end as one sequence ``[1, rows]`` ("ragged": no padding),
each with its own positions. Everything in the model but attention works row by row, so only
attention needs to know where one session ends: :class:`RaggedCache` appends each session's slice
of the new keys and values to that session's own cache, and the attention function installed by
:func:`install` attends each slice over its own session's keys, causally and inside the layer's
sliding window. Outside :func:`forward` that function is the model's previous attention, untouched.

transformers is kept from building masks by handing it an already "prepared" 4D mask (a marker
it returns as is; the attention function ignores it), and from inferring positions by passing
``position_ids``; so the cache is never asked for its length, and any transformers model whose
attention is looked up through ``AttentionInterface`` works.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kernels.hf_attention import TreeSpec, tree_forward, tree_spec
from kernels.reference.tree_attention import tree_attention_mask, tree_depths
from target_service import gemma_pass, kv_cache

PREFIX = "tandem_ragged_"  # the wrapped implementation's name follows


@dataclass
class RaggedCache:
    """Stands in for the model's cache during a ragged forward: one real cache per session."""

    caches: Sequence[DynamicCache]
    sizes: Sequence[int]  # new tokens per session, in sequence order
    # per session: the parents of its new tokens (a token tree, see target_service.tree), or None for a chain
    trees: Sequence[tuple[int, ...] | None] = ()
    marker: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 1, 1, 1, dtype=torch.bool))
    # layer -> each session's whole (keys, values) [1, kv_heads, its length, head_dim] after this update
    layers: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    # (new tokens, keys, window, tree) -> [1, 1, new tokens, keys] bool: built once per pass, not per layer
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    # session -> its tree for tandem's tree attention (built on first use, shared by every layer)
    specs: dict[int, TreeSpec] = field(default_factory=dict)
    # attend row by row, each over exactly the keys an autoregressive step at its position sees (see forward)
    row_exact: bool = False
    # The native row attention a row-exact pass attends with (_native_attention), or None (PyTorch).
    attention: Callable | None = None
    # (session, window) -> the native row attention's key ranges (_row_ranges): once per pass, not per layer
    row_plans: dict[tuple, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def tree(self, session: int) -> tuple[int, ...] | None:
        return self.trees[session] if self.trees else None

    def tree_spec(self, session: int) -> TreeSpec:
        if session not in self.specs:
            self.specs[session] = tree_spec(self.trees[session])
        return self.specs[session]

    def mask(
        self, size: int, keys: int, window: int | None, device: torch.device, tree: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Causal inside a slice of ``size`` new tokens after ``keys - size`` older ones (each token
        over its own path for a tree), within ``window``."""
        shape = (size, keys, window, tree)
        if shape not in self.masks:
            self.masks[shape] = tree_attention_mask(tree, size, keys, sliding_window=window, device=device)[:, None]
        return self.masks[shape]

    def alone(self, head_dim: int) -> Callable | None:
        """For a row-exact pass over one session where the native row attention is built (and takes
        ``head_dim``, a multiple of 16, as :func:`_rows_alone` requires): a function
        ``(layer_idx, query, key, value, window, scaling, softcap) -> [rows, heads * head_dim]`` that
        appends the layer's new keys and values to the session's cache and attends each row alone
        (what :meth:`update` and the installed attention do, without their per-layer generality).
        Else None."""
        native = self.attention if self.row_exact and len(self.caches) == 1 and head_dim % 16 == 0 else None
        return None if native is None else partial(self._attend_alone, native)

    def alone_buffers(self, layers: int) -> list[kv_cache.GrowableLayer] | None:
        """For a row-exact pass over one session whose cache holds ``layers`` layers already written
        in place (:class:`kv_cache.GrowableLayer`, float32, one sequence): those layers, for a writer
        that makes room (``reserve``), fills it itself and then calls ``advance`` (the native decoder
        layer, ``gemma_pass``). Else None (a first pass, another cache)."""
        if not self.row_exact or len(self.caches) != 1:
            return None
        held = self.caches[0].layers
        if len(held) < layers or not all(
            isinstance(layer, kv_cache.GrowableLayer) and layer.buffers is not None
            and layer.buffers[0].dtype == torch.float32 and layer.buffers[0].shape[0] == 1 for layer in held[:layers]
        ):
            return None
        return list(held[:layers])

    def alone_ranges(self, cached: int, window: int | None) -> tuple[torch.Tensor, ...]:
        """The one session's rows' key ranges for the native row attention (``_row_ranges``), once per
        pass and window, after ``cached`` positions."""
        ranges = self.row_plans.get((0, window))
        if ranges is None:
            ranges = self.row_plans[0, window] = _row_ranges(cached, self.sizes[0], window, self.tree(0))
        return ranges

    def _attend_alone(self, native, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      window: int | None, scaling: float, softcap: float | None) -> torch.Tensor:
        """query [rows, heads, head_dim] float32 contiguous; key/value [rows, kv_heads, head_dim] float32."""
        cache, size = self.caches[0], self.sizes[0]
        keys, values = cache.update(key.transpose(0, 1)[None], value.transpose(0, 1)[None], layer_idx)
        ranges = self.alone_ranges(keys.shape[2] - size, window)
        out = native(query, _rows_packed(keys[0]), _rows_packed(values[0]), *ranges, scaling, softcap or 0.0)
        return out.view(size, -1)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """``key``/``value``: [1, kv_heads, rows, head_dim]; each session's slice goes to its cache."""
        whole = []
        start = 0
        for cache, size in zip(self.caches, self.sizes):
            whole.append(cache.update(key[:, :, start : start + size], value[:, :, start : start + size], layer_idx))
            start += size
        self.layers[layer_idx] = whole
        return key, value  # unused: the attention reads ``layers``


_ACTIVE: contextvars.ContextVar[RaggedCache | None] = contextvars.ContextVar("tandem_ragged", default=None)


def install(model: torch.nn.Module) -> str | None:
    """Wraps the model's attention implementation so that it also runs ragged forwards; returns
    the new name. Ordinary forwards still go to the wrapped implementation, with the same masks.

    Wraps SDPA and implementations that build their own masks (tandem's tree attention); for
    others (eager, flash: their masks take other forms) it changes nothing and returns None.
    """
    inner = model.config._attn_implementation
    if inner.startswith(PREFIX):
        return inner
    if inner not in ALL_ATTENTION_FUNCTIONS or (inner != "sdpa" and inner in ALL_MASK_ATTENTION_FUNCTIONS):
        return None
    name = PREFIX + inner
    AttentionInterface.register(name, _ragged_attention(inner))
    if inner in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise RuntimeError(f"{type(model).__name__} refused attn_implementation={name!r}")
    return name


def forward(
    model: torch.nn.Module,
    caches: Sequence[DynamicCache],
    token_ids: Sequence[Sequence[int]],
    device: torch.device | str,
    want_hidden: bool = False,
    last_only: Sequence[bool] | None = None,
    no_logits: Sequence[bool] | None = None,
    trees: Sequence[Sequence[int] | None] | None = None,
    row_exact: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Runs each session's ``token_ids`` after its cache, in one pass (the model must be
    :func:`install`-ed); appends to every cache. Returns per session its logits ``[n, vocab]``
    (``[1, vocab]`` where ``last_only`` says so: a prompt's other rows would cost the LM head for
    nothing; ``[0, vocab]`` where ``no_logits`` says so: the caller scores its rows from the
    hidden states) and, with ``want_hidden``, its final hidden states ``[n, hidden_size]``.

    ``trees`` gives a session's new tokens as a token tree (``parents`` as in
    ``kernels.reference.tree_attention``: -1 for the first, the last committed token); each then
    sits at position ``cache length + depth`` and attends over its own path only.

    ``row_exact`` (SDPA only): each row attends alone, over exactly the keys a one-token step at its
    position would (the cache, its path, the window), so its output is bit for bit that step's. A
    multi-row SDPA call sums in another order than a one-row call; with float32 activations that
    is rounding noise, but int8 activations (``tandem.quant``) round it into whole steps of a
    quantization level, enough to change a greedy token now and then."""
    if not model.config._attn_implementation.startswith(PREFIX):
        raise RuntimeError("ragged.forward needs ragged.install(model) first")
    sizes = [len(ids) for ids in token_ids]
    if not sizes or min(sizes) < 1:
        raise ValueError("every session of a ragged forward needs at least one token")
    flat = [token for ids in token_ids for token in ids]
    tree_list = [tuple(tree) if tree is not None else None for tree in trees] if trees is not None else []
    offsets = [  # each new token's position after its session's cache: its index, or its depth in a tree
        tree_depths(torch.tensor(tree_list[i]))[0].tolist() if tree_list and tree_list[i] is not None else range(size)
        for i, size in enumerate(sizes)
    ]
    positions = [kv_cache.cache_length(cache) + d for cache, depth in zip(caches, offsets) for d in depth]
    input_ids = torch.tensor([flat], dtype=torch.long, device=device)  # [1, rows]
    position_ids = torch.tensor([positions], dtype=torch.long, device=device)  # [1, rows]
    last_only = list(last_only) if last_only is not None else [False] * len(sizes)
    no_logits = list(no_logits) if no_logits is not None else [False] * len(sizes)
    kept = [0 if none else 1 if last else size for size, last, none in zip(sizes, last_only, no_logits)]  # logit rows
    logits_to_keep: int | torch.Tensor = 0  # all rows
    if sum(kept) < len(flat):
        ends = torch.tensor(sizes).cumsum(0)  # [sessions]
        logits_to_keep = torch.cat(
            [torch.arange(int(end) - keep, int(end)) for end, keep in zip(ends, kept)]
        ).to(device)  # [sum(kept)] row indices (none at all: an empty index, and an LM head over no rows)
    attention = _native_attention(_attention_isa(model)) if row_exact else None
    ragged = RaggedCache(caches, sizes, tree_list, row_exact=row_exact, attention=attention)
    lean = gemma_pass.for_model(model)
    with _active(ragged):
        if lean is not None:  # a quantized Gemma 3: the same computation without the module tree
            attend = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
            final, all_logits = lean.run(attend, ragged, input_ids[0], position_ids[0], logits_to_keep)
        else:
            out = model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=ragged.marker,
                cache=ragged,
                use_cache=True,
                output_hidden_states=want_hidden,
                logits_to_keep=logits_to_keep,
            )
            final, all_logits = (out.hidden_states[-1][0] if want_hidden else None), out.logits[0]
    logits = list(all_logits.split(kept))  # [n or 1, vocab] each
    hidden = list(final.split(sizes)) if want_hidden else None  # [n, hidden_size] each
    return logits, hidden


@contextlib.contextmanager
def _active(ragged: RaggedCache) -> Iterator[None]:
    token = _ACTIVE.set(ragged)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _ragged_attention(inner: str) -> Callable:
    """The attention function of ``PREFIX + inner``: ``inner`` itself, or per session when ragged."""
    wants_mask = inner == "sdpa"  # it applies the mask it is given; the others build their own

    def attention(module, query, key, value, attention_mask, **kwargs):  # query: [1, heads, rows, head_dim]
        inner_fn = ALL_ATTENTION_FUNCTIONS[inner]
        ragged = _ACTIVE.get()
        if ragged is None or attention_mask is not ragged.marker:
            return inner_fn(module, query, key, value, attention_mask, **kwargs)
        window = kwargs.get("sliding_window")
        outputs = []
        start = 0
        for session, ((keys, values), size) in enumerate(zip(ragged.layers[module.layer_idx], ragged.sizes)):
            q = query[:, :, start : start + size]  # [1, heads, n, head_dim]
            start += size
            tree = ragged.tree(session)
            mask = None
            if wants_mask and ragged.row_exact:
                out = _rows_alone(q, keys, values, window, tree, kwargs, ragged.attention, ragged.row_plans,
                                  (session, window))
            elif wants_mask:
                if window and keys.shape[2] > window + size - 1:  # keys no query of this slice can see
                    keys, values = keys[:, :, -(window + size - 1) :], values[:, :, -(window + size - 1) :]
                if size > 1:  # causal inside the slice (along each path of a tree), and the window where it cuts
                    mask = ragged.mask(size, keys.shape[2], window, q.device, tree)  # [1, 1, n, keys]
                out, _ = inner_fn(module, q, keys, values, mask, **kwargs)  # [1, n, heads, head_dim]
            elif tree is not None:  # tandem's tree attention reads the tree from its context
                with tree_forward(ragged.tree_spec(session)):
                    out, _ = inner_fn(module, q, keys, values, mask, **kwargs)  # [1, n, heads, head_dim]
            else:
                out, _ = inner_fn(module, q, keys, values, mask, **kwargs)  # [1, n, heads, head_dim]
            outputs.append(out)
        # [1, rows, heads, head_dim] (a lone session's output as is: no copy on its hot path)
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None

    return attention


def _rows_alone(query, keys, values, window, tree, kwargs, native: Callable | None, plans: dict | None = None,
                key=None) -> torch.Tensor:
    """Each row of ``query`` [1, heads, n, head_dim] attended alone over its visible keys of
    ``keys``/``values`` [1, kv_heads, cached + n, head_dim]: the cache, then the new rows up to
    itself (its path in a tree), the last ``window`` of them; the same computation a one-token
    step at that position makes (``native``, the native ``row_attention``, where it is given, else
    :func:`_attend_one` per row); -> [1, n, heads, head_dim]. ``plans[key]`` keeps the native call's
    key ranges (:func:`_row_ranges`), the same for every layer of a pass with this window."""
    size = query.shape[2]
    cached = keys.shape[2] - size
    if native is not None and query.dtype == torch.float32 and query.shape[-1] % 16 == 0:
        ranges = plans.get(key) if plans is not None else None
        if ranges is None:
            ranges = _row_ranges(cached, size, window, tree)
            if plans is not None:
                plans[key] = ranges
        lo, hi, index, count = ranges
        out = native(query[0].transpose(0, 1).contiguous(), _rows_packed(keys[0]), _rows_packed(values[0]),
                     lo, hi, index, count,
                     float(kwargs.get("scaling") or query.shape[-1] ** -0.5), float(kwargs.get("softcap") or 0.0))
        return out[None]  # [1, n, heads, head_dim]
    paths = _paths(tree, size)
    outputs = []
    for row in range(size):
        if tree is None or paths[row] == list(range(row + 1)):  # a chain prefix: the keys as they are
            k, v = keys[:, :, : cached + row + 1], values[:, :, : cached + row + 1]
        else:
            index = torch.cat([torch.arange(cached), cached + torch.tensor(paths[row])]).to(keys.device)
            k, v = keys.index_select(2, index), values.index_select(2, index)
        if window and k.shape[2] > window:
            k, v = k[:, :, -window:], v[:, :, -window:]
        outputs.append(_attend_one(query[:, :, row : row + 1], k, v, kwargs))
    return torch.cat(outputs, dim=1)


def _rows_packed(t: torch.Tensor) -> torch.Tensor:
    """t [kv_heads, positions, head_dim] as the native row attention reads it: each head's positions
    contiguous (a cache buffer's view already is; anything else is copied)."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def _row_ranges(cached: int, size: int, window: int | None, tree) -> tuple[torch.Tensor, ...]:
    """The native row attention's keys per row: (lo, hi [n], extra [n, E], count [n]) int64 (see
    row_attention.cpp): cache positions [lo, hi), then ``extra[:count]`` (a tree path off the chain)."""
    paths = _paths(tree, size)
    lo, hi, extra, count = [], [], [], []
    for row in range(size):
        contiguous = tree is None or paths[row] == list(range(row + 1))
        path = [] if contiguous else [cached + node for node in paths[row]]
        end = cached + row + 1 if contiguous else cached
        total = end + len(path)
        start = max(0, total - window) if window else 0
        dropped_path = max(0, start - end)  # the window reaches into the path only past its start
        lo.append(min(start, end))
        hi.append(end)
        extra.append(path[dropped_path:])
        count.append(len(path) - dropped_path)
    index = torch.zeros(size, max(1, max(count)), dtype=torch.long)
    for row, nodes in enumerate(extra):
        index[row, : len(nodes)] = torch.tensor(nodes, dtype=torch.long) if nodes else index[row, :0]
    return torch.tensor(lo), torch.tensor(hi), index, torch.tensor(count)


_NATIVE: dict[str | None, Callable | None] = {}  # isa -> its row_attention, or None where it is not built
_ISAS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the isa its passes attend with


def _native_attention(isa: str | None) -> Callable | None:
    """tandem.quant's row_attention built for ``isa``, or None (then PyTorch, row by row)."""
    if isa not in _NATIVE:
        from tandem.quant.native import KernelUnavailable, load_row_attention

        try:
            _NATIVE[isa] = load_row_attention(isa) if isa else None
        except KernelUnavailable:
            _NATIVE[isa] = None
    return _NATIVE[isa]


def _attention_isa(model) -> str | None:
    """The build a row-exact pass of ``model`` attends with: its int8 kernel's, as its native decoder
    layer (gemma_pass), compiled for that kernel, does, so the two round alike; where the kernel is
    PyTorch's reference, this host's (the probe's)."""
    if model not in _ISAS:
        from tandem.quant.modules import int8_kernel_isa
        from tandem.quant.native import ISA_FLAGS, probe

        isa = int8_kernel_isa(model)
        _ISAS[model] = isa if isa in ISA_FLAGS else probe()[0]
    return _ISAS[model]


def _attend_one(query, keys, values, kwargs) -> torch.Tensor:
    """Plain attention of one query [1, heads, 1, head_dim] over every key [1, kv_heads, keys,
    head_dim] (grouped-query heads share theirs), float32 softmax; -> [1, 1, heads, head_dim].

    The query is copied first, so its alignment (and with it any kernel path) does not depend on
    where in a pass its row sat."""
    heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[-1]
    scale = kwargs.get("scaling") or dim**-0.5
    q = query[0, :, 0].reshape(kv_heads, heads // kv_heads, dim).contiguous()  # [kv_heads, group, dim]
    scores = torch.matmul(q, keys[0].transpose(1, 2)) * scale  # [kv_heads, group, keys]
    softcap = kwargs.get("softcap")
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    out = torch.matmul(weights, values[0])  # [kv_heads, group, dim]
    return out.reshape(1, 1, heads, dim)


def _paths(tree, size: int) -> list[list[int]]:
    """Per row, the rows from the first to itself along its tree path (a chain: every earlier row)."""
    if tree is None:
        return [list(range(row + 1)) for row in range(size)]
    paths: list[list[int]] = []
    for row, parent in enumerate(tree):
        paths.append([*paths[parent], row] if parent >= 0 else [row])
    return paths
