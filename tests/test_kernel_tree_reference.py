"""The PyTorch reference of tree verification (``kernels.reference.tree``), ahead of its kernel.

Deterministic cases pin the walk (first-child / next-sibling order, ragged trees, greedy rows) and
agreement with ``verify_chain`` on chains. Statistical cases check losslessness for both kinds of
siblings: deterministic top-k children (one-hot q each) and children drawn i.i.d. from one q.
Bound (as in test_verify_reference.py): chi-square p-value > 1e-3 and total variation below 4x
the mean TV of an exact sampler at that n; fixed seeds; each case also shows that committing the
first child unconditionally would break the bound.
"""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from kernels.reference import draw_exponentials, draw_uniforms, target_probs, verify_chain
from kernels.reference.tree import verify_tree


def _params(batch: int, temperature: float = 1.0, top_p: float = 0.0, top_k: int = 0):
    return torch.full((batch,), temperature), torch.full((batch,), top_p), torch.full((batch,), top_k, dtype=torch.long)


def _one_hot_q(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic children: q_ids, q_probs [batch, n, 1] one-hot on each node's token."""
    return tokens[..., None], torch.ones(*tokens.shape, 1)


def test_chains_agree_with_verify_chain() -> None:
    g = torch.Generator().manual_seed(0)
    batch, k, vocab, m = 16, 4, 23, 3
    logits = 2 * torch.randn(batch, k + 1, vocab, generator=g)  # [batch, k+1, vocab]
    draft = torch.where(torch.rand(batch, k, generator=g) < 0.6, logits[:, :k].argmax(-1),
                        torch.randint(0, vocab, (batch, k), generator=g))  # [batch, k]
    q_ids = torch.cat([draft[..., None], torch.randint(0, vocab, (batch, k, m - 1), generator=g)], -1)  # [batch, k, m]
    q_probs = torch.softmax(torch.randn(batch, k, m, generator=g), -1)  # [batch, k, m]
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3] * 4)
    top_p = torch.tensor([0.0, 0.0, 0.9, 0.0] * 4)
    top_k = torch.tensor([0, 0, 0, 6] * 4)
    uniforms, exponentials = draw_uniforms((batch, k), g), draw_exponentials((batch, vocab), g)
    num_draft = torch.randint(0, k + 1, (batch,), generator=g)  # [batch]
    parents = torch.arange(k).expand(batch, k)  # [batch, k]: node i's parent is node i-1
    args = (q_ids, q_probs, temperature, top_p, top_k, uniforms, exponentials, num_draft)
    chain_accepted, chain_token = verify_chain(logits, draft, *args)
    tree_accepted, nodes, tree_token = verify_tree(logits, draft, parents, *args)
    assert tree_accepted.tolist() == chain_accepted.tolist() and tree_token.tolist() == chain_token.tolist()
    for b in range(batch):  # the accepted path of a chain is nodes 1..num_accepted
        assert nodes[b, : tree_accepted[b]].tolist() == list(range(1, int(tree_accepted[b]) + 1))
        assert (nodes[b, tree_accepted[b]:] == -1).all()


def test_greedy_walk_tries_siblings_in_order_and_descends() -> None:
    vocab = 10
    logits = torch.zeros(1, 6, vocab)  # [1, n+1, vocab]; n = 5
    logits[0, 0, 3] = logits[0, 2, 7] = logits[0, 4, 1] = logits[0, 5, 8] = 5.0  # argmax of rows 0, 2, 4, 5
    logits[0, 1, 0] = logits[0, 3, 0] = 5.0
    # Root -> {1: token 4 (wrong), 2: token 3 (right)}; node 2 -> {3: 5 (wrong), 4: 7 (right)}; node 4 -> {5: 2 (wrong)}.
    draft = torch.tensor([[4, 3, 5, 7, 2]])
    parents = torch.tensor([[0, 0, 2, 2, 4]])
    num_accepted, nodes, token = verify_tree(
        logits, draft, parents, *_one_hot_q(draft), *_params(1, temperature=0.0), torch.ones(1, 5), torch.ones(1, vocab)
    )
    assert num_accepted.tolist() == [2] and nodes[0, :2].tolist() == [2, 4] and token.tolist() == [1]
    # A ragged tree of 2 nodes: node 2 (right) is accepted and is a leaf: the bonus is row 2's argmax.
    num_accepted, nodes, token = verify_tree(
        logits, draft, parents, *_one_hot_q(draft), *_params(1, temperature=0.0), torch.ones(1, 5),
        torch.ones(1, vocab), torch.tensor([2]),
    )
    assert num_accepted.tolist() == [1] and nodes[0, 0].item() == 2 and token.tolist() == [7]


def _tv_bound(probs: torch.Tensor, n: int) -> float:
    probs = probs.double()
    return 4.0 * 0.5 * torch.sqrt(2 * probs * (1 - probs) / (torch.pi * n)).sum().item()


def _assert_distributed_as(samples: torch.Tensor, probs: torch.Tensor, label: str) -> None:
    n, vocab = samples.numel(), probs.shape[0]
    counts = torch.bincount(samples, minlength=vocab).double()  # [vocab]
    probs = probs.double()
    assert counts[probs == 0].sum() == 0, f"{label}: tokens outside p's support"
    support = probs > 0
    p_value = chisquare(counts[support].numpy(), (probs[support] / probs[support].sum() * n).numpy()).pvalue
    tv, bound = 0.5 * (counts / n - probs).abs().sum().item(), _tv_bound(probs, n)
    assert p_value > 1e-3 and tv < bound, f"{label}: chi-square p={p_value:.2e}, TV={tv:.4f} (bound {bound:.4f})"


def _first_token(num_accepted, nodes, token, draft) -> torch.Tensor:
    """The first committed token of each request: the first accepted node's, else next_token."""
    first_node = nodes[:, 0].clamp_min(1)  # [batch]
    return torch.where(num_accepted > 0, draft.gather(1, (first_node - 1)[:, None])[:, 0], token)


def test_deterministic_top_k_children_are_lossless() -> None:
    """Root with the draft's top-3 as one-hot children (in the draft's order), each a leaf."""
    g = torch.Generator().manual_seed(1)
    vocab, n, trials = 6, 3, 6000
    row = 1.2 * torch.randn(n + 1, vocab, generator=g)  # [n+1, vocab]
    p = target_probs(row[None], *_params(1, 1.0, 0.0, 5))[0]  # [n+1, vocab], top-5
    children = torch.tensor([p[0].argsort()[0], p[0].argsort()[1], p[0].argmax()])  # least likely first
    draft = children.expand(trials, n)  # [trials, n]
    parents = torch.zeros(trials, n, dtype=torch.long)  # [trials, n]: all children of the root
    num_accepted, nodes, token = verify_tree(
        row.expand(trials, n + 1, vocab), draft, parents, *_one_hot_q(draft), *_params(trials, 1.0, 0.0, 5),
        draw_uniforms((trials, n), g), draw_exponentials((trials, vocab), g),
    )
    _assert_distributed_as(_first_token(num_accepted, nodes, token, draft), p[0], "first token")
    leaf = nodes[:, 0]  # [trials]; after a leaf, the bonus comes from that leaf's row
    for child in (1, 2, 3):
        chosen = leaf == child
        if chosen.sum() >= 500:
            _assert_distributed_as(token[chosen], p[child], f"bonus after child {child}")
    assert 0.5 * (torch.nn.functional.one_hot(children[0], vocab) - p[0]).abs().sum() > 2 * _tv_bound(p[0], trials)


def test_iid_sampled_siblings_are_lossless() -> None:
    """Root with 2 children drawn i.i.d. from q; the row after a node depends on its token only."""
    g = torch.Generator().manual_seed(2)
    vocab, n, trials = 5, 2, 6000
    table = 1.5 * torch.randn(vocab + 1, vocab, generator=g)  # [vocab+1, vocab]: row of the root, then per token
    q_row = torch.tensor([0.4, 0.05, 0.05, 0.1, 0.4])  # [vocab], unlike p
    draft = torch.multinomial(q_row, trials * n, replacement=True, generator=g).reshape(trials, n)  # [trials, n]
    logits = torch.cat([table[0].expand(trials, 1, vocab), table[1:][draft]], 1)  # [trials, n+1, vocab]
    num_accepted, nodes, token = verify_tree(
        logits, draft, torch.zeros(trials, n, dtype=torch.long),
        torch.arange(vocab).expand(trials, n, vocab), q_row.expand(trials, n, vocab), *_params(trials),
        draw_uniforms((trials, n), g), draw_exponentials((trials, vocab), g),
    )
    p_root = torch.softmax(table[0], -1)  # [vocab]
    first = _first_token(num_accepted, nodes, token, draft)  # [trials]
    _assert_distributed_as(first, p_root, "first token")
    accepted = num_accepted > 0  # the bonus after an accepted child ~ p(. | its token)
    for t in range(vocab):
        chosen = accepted & (first == t)
        if chosen.sum() >= 500:
            _assert_distributed_as(token[chosen], torch.softmax(table[1 + t], -1), f"bonus after token {t}")
    assert 0.5 * (q_row - p_root).abs().sum() > 2 * _tv_bound(p_root, trials)
