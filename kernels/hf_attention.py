"""Tree attention inside Hugging Face models: an ``AttentionInterface`` function over the session cache.

transformers' model definitions (Llama, Gemma 3, ...) call ``ALL_ATTENTION_FUNCTIONS[name]`` with
``(module, query [b, heads, n_q, d], key, value [b, kv_heads, kv_len, d], attention_mask,
dropout=, scaling=, sliding_window=, softcap=?, **kwargs)`` right after ``cache.update``, so key
and value are the layer's whole cache: the prefix, then this forward's ``n_q`` new entries. That
is exactly the layout of ``kernels.reference.tree_attention`` with ``prefix_len = kv_len - n_q``
(the target's cache, ``target_service.kv_cache``, keeps full history on every layer, so this
holds for Gemma 3's sliding layers too; their window comes in as ``sliding_window``).

The mask is not taken from transformers. The implementation names registered here have no entry
in transformers' ``AttentionMaskInterface``, so the models skip building masks altogether and
pass ``attention_mask=None`` (as for vLLM/TGI-style backends); the function builds its own from
the tree of the current forward, which the caller sets around the forward::

    with tree_forward(parents):  # [n_q] ints, -1 = the root (the last committed token)
        model(input_ids=ids, position_ids=tree_position_ids(parents, prefix_len), cache=cache)

Without ``tree_forward`` the block is a chain (plain causal attention), so prefill, decode and
chain verification need nothing. The caller must give tree forwards ``position_ids =
prefix_len + depth`` (``tree_position_ids``), and afterwards keep only the accepted path in the
cache (``kernels.compact_kv``). Padding masks are not supported (the target batches sessions
without padding: ``target_service.ragged`` calls this function once per session of a pass); a 4D
mask passed explicitly is honoured through SDPA.

Backends: the Triton kernel on CUDA for blocks of at most ``MAX_KERNEL_QUERIES`` tokens, and for
trees as large as it takes (``kernels.tree_attention.fits``); SDPA for longer chains, i.e. prompts
(its flash path for a first prompt that fits the window, a dense mask otherwise); the PyTorch
reference for blocks elsewhere (CPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kernels.reference.tree_attention import parents_table, tree_attention, tree_attention_mask, tree_depths

log = logging.getLogger(__name__)

NAME = "tandem_tree"  # Triton on CUDA, the reference elsewhere: what install() sets
NAME_TRITON = "tandem_tree_triton"  # always the kernel (tests run it interpreted on CPU)
NAME_REFERENCE = "tandem_tree_reference"  # always the reference (never the kernel)
MAX_KERNEL_QUERIES = 32  # chains longer than this (prompts) go to SDPA; trees as far as the kernel fits


@dataclass
class TreeSpec:
    """The tree of the current forward: ``parents [n_q]`` (or ``[batch, n_q]``), -1 for a root."""

    parents: torch.Tensor  # [n_q] or [batch, n_q] int64, on the CPU
    _tables: dict = field(default_factory=dict, repr=False)  # device -> kernel tables, built once per forward

    def kernel_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's (ancestors, depth) tables on ``device``, shared by every layer of the forward."""
        if device not in self._tables:
            from kernels.tree_attention import tree_tables

            self._tables[device] = tree_tables(self.parents, self.parents.shape[-1], device)
        return self._tables[device]


_TREE: contextvars.ContextVar[TreeSpec | None] = contextvars.ContextVar("tandem_tree", default=None)
_CHAIN_TABLES: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}  # (n_q, device) -> tables


def _kernel_tables(spec: TreeSpec | None, n_q: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's mask tables without a host-to-device copy per layer: the forward's tree's,
    or a chain's, kept for the life of the process (one small pair per block length)."""
    if spec is not None:
        return spec.kernel_tables(device)
    if (n_q, device) not in _CHAIN_TABLES:
        from kernels.tree_attention import tree_tables

        _CHAIN_TABLES[n_q, device] = tree_tables(None, n_q, device)
    return _CHAIN_TABLES[n_q, device]


def tree_spec(parents: Sequence[int] | torch.Tensor) -> TreeSpec:
    """The validated tree of ``parents`` ([n_q] or [batch, n_q]); one spec shared by several
    forwards (or layers) builds the kernel's tables once."""
    table = torch.as_tensor(parents, dtype=torch.long).cpu()  # [n_q] or [batch, n_q]
    table = parents_table(table, table.shape[-1])  # validated; [rows, n_q]
    return TreeSpec(table[0] if table.shape[0] == 1 else table)


@contextlib.contextmanager
def tree_forward(parents: Sequence[int] | torch.Tensor | TreeSpec) -> Iterator[TreeSpec]:
    """Makes the forwards run inside this block attend under the tree ``parents`` (see the module doc)."""
    spec = parents if isinstance(parents, TreeSpec) else tree_spec(parents)
    token = _TREE.set(spec)
    try:
        yield spec
    finally:
        _TREE.reset(token)


def tree_position_ids(parents: Sequence[int] | torch.Tensor, prefix_len: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """``[rows, n_q]`` int64 position ids of a tree forward: ``prefix_len + depth`` (RoPE sees each node
    where it would sit in the chain of its own path)."""
    return (prefix_len + tree_depths(torch.as_tensor(parents, dtype=torch.long))).to(device)


def _kernel_fits(group: int, n_q: int, head_dim: int) -> bool:
    from kernels.tree_attention import fits

    return fits(group, n_q, head_dim)


def _sdpa(query, key, value, mask, scaling) -> torch.Tensor:  # [batch, heads, n_q, head_dim]
    """PyTorch SDPA under a boolean mask ``[batch or 1, 1 or heads, n_q, kv_len]``, GQA by repetition."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)  # [batch, heads, kv_len, head_dim]
    value = value.repeat_interleave(group, dim=1)  # [batch, heads, kv_len, head_dim]
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, n_q, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]: the layer's whole cache
    value: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    attention_mask: torch.Tensor | None,
    backend: str,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([batch, n_q, heads, head_dim], no weights)
    if dropout:
        raise NotImplementedError("tandem tree attention is for inference: dropout must be 0 (call model.eval())")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise NotImplementedError("tandem tree attention is causal (tree-causal); this layer is bidirectional")
    batch, _, n_q, head_dim = query.shape
    kv_len = key.shape[2]
    scaling = head_dim**-0.5 if scaling is None else scaling
    if attention_mask is not None:  # a mask prepared by the caller: honoured as given
        out = _sdpa(query, key, value, attention_mask, scaling)  # [batch, heads, n_q, head_dim]
        return out.transpose(1, 2).contiguous(), None
    spec = _TREE.get()
    parents = None
    if spec is not None:
        parents = spec.parents
        if parents.shape[-1] != n_q:
            raise ValueError(f"tree_forward was given {parents.shape[-1]} nodes but the forward has {n_q} tokens")
    if n_q > kv_len:
        raise ValueError(f"the cache holds {kv_len} positions, fewer than the forward's {n_q} tokens")

    use_kernel = backend == "triton" or (
        backend == "auto" and query.is_cuda and (n_q <= MAX_KERNEL_QUERIES or spec is not None)
        and _kernel_fits(query.shape[1] // key.shape[1], n_q, head_dim))
    if use_kernel:
        from kernels.tree_attention import tree_attention as kernel_tree_attention

        # [batch, heads, n_q, head_dim], laid out [batch, n_q, heads, head_dim]: the transpose below is free
        out = kernel_tree_attention(query, key, value, parents, scale=scaling, sliding_window=sliding_window,
                                    softcap=softcap, tables=_kernel_tables(spec, n_q, query.device))
    elif n_q <= MAX_KERNEL_QUERIES or softcap:  # SDPA has no soft cap
        out = tree_attention(query, key, value, parents, scale=scaling, sliding_window=sliding_window,
                             softcap=softcap)  # [batch, heads, n_q, head_dim]
    elif parents is None and kv_len == n_q and not (sliding_window and sliding_window < n_q):
        # A first prompt (empty cache) within the window: plain causal, SDPA's flash path, GQA native.
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=True)  # [batch, heads, n_q, head_dim]
    else:  # a prompt after a prefix, or past the window: SDPA under the same mask as the kernel's
        mask = tree_attention_mask(parents, n_q, kv_len, sliding_window=sliding_window, batch=batch,
                                   device=query.device)  # [batch, n_q, kv_len]
        out = _sdpa(query, key, value, mask[:, None], scaling)  # [batch, heads, n_q, head_dim]
    return out.transpose(1, 2).contiguous(), None  # [batch, n_q, heads, head_dim]


def attention_forward(module, query, key, value, attention_mask, **kwargs):
    """``NAME``: the Triton kernel on CUDA, the reference (or SDPA for prompts) elsewhere."""
    return _attention(module, query, key, value, attention_mask, "auto", **kwargs)


def attention_forward_triton(module, query, key, value, attention_mask, **kwargs):
    """``NAME_TRITON``: always the kernel (forwards it does not fit are refused)."""
    return _attention(module, query, key, value, attention_mask, "triton", **kwargs)


def attention_forward_reference(module, query, key, value, attention_mask, **kwargs):
    """``NAME_REFERENCE``: never the kernel."""
    return _attention(module, query, key, value, attention_mask, "reference", **kwargs)


def register() -> None:
    """Registers the three names with transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionInterface.register(NAME_TRITON, attention_forward_triton)
    AttentionInterface.register(NAME_REFERENCE, attention_forward_reference)


def install_on_cuda(model: torch.nn.Module, device: str | torch.device) -> str:
    """Installs ``NAME`` when ``device`` is CUDA and the kernel imports; returns the implementation in use.

    The target engine's hook (one line): on CPU, or with a broken Triton, the model keeps its own
    attention (the reference would be no faster than SDPA there) and a warning says why.
    """
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return model.config._attn_implementation
    try:
        import kernels.tree_attention  # noqa: F401  (Triton and its driver must load)
    except Exception as error:  # noqa: BLE001  (ImportError, or Triton failing to find its compiler/driver)
        log.warning("Triton tree attention unavailable (%s); keeping %s", error, model.config._attn_implementation)
        return model.config._attn_implementation
    install(model, NAME)
    return NAME


def install(model: torch.nn.Module, name: str = NAME) -> torch.nn.Module:
    """Switches ``model`` (a transformers model) to tree attention; returns it.

    The target engine calls it through ``install_on_cuda``. The model
    then runs prefill, decode and chain verification exactly as before (a chain is the default
    tree) and tree verification inside ``tree_forward``.
    """
    register()
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise RuntimeError(f"{type(model).__name__} refused attn_implementation={name!r}")
    log.info("attention: %s (%s)", name, "Triton kernel on CUDA" if name == NAME else name)
    return model
