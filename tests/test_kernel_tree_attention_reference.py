"""The PyTorch reference of tree attention (``kernels.reference.tree_attention``), on its own.

Checked against independent formulations: a per-query loop that gathers each node's path by
walking its parents and runs a plain softmax over the keys it may see (float64); PyTorch's SDPA
with ``is_causal`` for a chain over an empty prefix and with an explicit causal mask after a
prefix; and, for sliding windows, transformers' own sliding-window mask for a chain.
"""

from __future__ import annotations

import pytest
import torch

from kernels.reference.tree_attention import ancestor_mask, tree_attention, tree_attention_mask, tree_depths


def _path(parents: list[int], node: int) -> list[int]:
    """Node indices from the root down to ``node`` (inclusive)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _per_query(q, k, v, parents, prefix_lens, scale, window=None, softcap=None):
    """Loops over rows, heads and nodes; float64; each node sees prefix + its path (see module doc)."""
    batch, q_heads, n_q, head_dim = q.shape
    group = q_heads // k.shape[1]
    out = torch.zeros(batch, q_heads, n_q, head_dim, dtype=torch.float64)  # [batch, q_heads, n_q, head_dim]
    for b in range(batch):
        tree = parents[b] if isinstance(parents[0], list) else parents
        prefix = int(prefix_lens[b])
        for i in range(n_q):
            path = _path(tree, i)
            position = prefix + len(path) - 1
            keys = list(range(prefix)) + [prefix + node for node in path]
            positions = list(range(prefix)) + [prefix + depth for depth in range(len(path))]
            if window:
                keys = [key for key, pos in zip(keys, positions) if pos > position - window]
            for h in range(q_heads):
                kh = k[b, h // group, keys].double()  # [keys, head_dim]
                scores = scale * (kh @ q[b, h, i].double())  # [keys]
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                out[b, h, i] = torch.softmax(scores, 0) @ v[b, h // group, keys].double()
    return out


def test_ancestor_mask_and_depths() -> None:
    parents = [-1, 0, 0, 1, 3, -1, 5]
    mask = ancestor_mask(parents)[0]  # [n_q, n_q]
    for i in range(len(parents)):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(_path(parents, i))
    assert tree_depths(parents)[0].tolist() == [0, 1, 1, 2, 3, 0, 1]
    assert torch.equal(ancestor_mask([-1, 0, 1, 2])[0], torch.ones(4, 4, dtype=torch.bool).tril())  # a chain
    with pytest.raises(ValueError, match="parents"):
        ancestor_mask([-1, 1])  # a node its own parent


@pytest.mark.parametrize(
    "parents, window, softcap",
    [
        ([-1, 0, 1, 2, 3], None, None),  # chain
        ([-1, 0, 1, 1, 3, 4], None, None),  # one branch
        ([-1, 0, 0, 0, 0], None, None),  # wide
        ([-1, 0, 0, 1, 2, 2, 5], 4, None),  # tree + window cutting the block
        ([-1, 0, 1], 9, 3.0),  # window cutting the prefix, softcap
    ],
)
def test_reference_matches_per_query_loop(parents, window, softcap) -> None:
    g = torch.Generator().manual_seed(len(parents))
    n_q = len(parents)
    q = torch.randn(2, 4, n_q, 8, generator=g)  # [batch, q_heads, n_q, head_dim]
    k = torch.randn(2, 2, 20, 8, generator=g)  # [batch, kv_heads, kv_len, head_dim]
    v = torch.randn(2, 2, 20, 8, generator=g)  # [batch, kv_heads, kv_len, head_dim]
    prefix = torch.tensor([20 - n_q, 6])  # [batch]: a full row and a padded one
    got = tree_attention(q, k, v, parents, prefix, scale=0.4, sliding_window=window, softcap=softcap)
    want = _per_query(q, k, v, parents, prefix, 0.4, window, softcap)
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_per_row_trees() -> None:
    g = torch.Generator().manual_seed(9)
    parents = [[-1, 0, 1, 2], [-1, 0, 0, 1]]
    q = torch.randn(2, 2, 4, 8, generator=g)  # [batch, q_heads, n_q, head_dim]
    k, v = torch.randn(2, 1, 9, 8, generator=g), torch.randn(2, 1, 9, 8, generator=g)  # [batch, kv_heads, kv_len, d]
    got = tree_attention(q, k, v, torch.tensor(parents))
    assert torch.allclose(got.double(), _per_query(q, k, v, parents, [5, 5], 8**-0.5), atol=1e-5)


def test_chain_equals_sdpa_causal() -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, 7, 16, generator=g)  # [batch, q_heads, n_q, head_dim]
    k = torch.randn(2, 3, 7, 16, generator=g)  # empty prefix: kv_len == n_q
    v = torch.randn(2, 3, 7, 16, generator=g)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(tree_attention(q, k, v), sdpa, atol=1e-5)
    # After a prefix of 10: each block token i sees keys 0 .. 10 + i.
    k, v = torch.randn(2, 3, 17, 16, generator=g), torch.randn(2, 3, 17, 16, generator=g)
    causal = torch.ones(7, 17, dtype=torch.bool).tril(10)  # [n_q, kv_len]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
    assert torch.allclose(tree_attention(q, k, v), sdpa, atol=1e-5)


def test_chain_window_equals_transformers_sliding_mask() -> None:
    """A chain's window is transformers' own: the query at cache position p sees keys > p - window."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    for window in (1, 3, 8):
        hf = sdpa_mask(batch_size=1, q_length=5, kv_length=17, q_offset=12, kv_offset=0,
                       mask_function=sliding_window_causal_mask_function(window), allow_is_causal_skip=False)
        ours = tree_attention_mask(None, 5, 17, sliding_window=window)  # [1, n_q, kv_len]
        assert torch.equal(hf[0, 0], ours[0]), window
