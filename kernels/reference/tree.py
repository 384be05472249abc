"""Tree verification of draft token trees (PyTorch reference; the Triton kernel will share it).

A tree drafter proposes several continuations at once: nodes ``1..n``, node i carrying draft token
``d_i`` and a parent ``parents[i-1]`` in ``0..i-1`` (node 0 is the root, the last committed token;
parents precede their children). The target runs one forward pass over the root and all nodes
under the tree (ancestor) mask and gets n+1 rows of logits: row i is the target's next-token
distribution after the path root -> ... -> node i. ``p_i`` is that row's ``target_probs``.

The children of a node, in increasing node index (its first child, then each next sibling), are
tried in turn against a running target distribution r, starting from ``r = p_node``:

- sampled requests: child c is **accepted** when ``r(d_c) > 0 and u_c * q_c(d_c) <= r(d_c)``
  (probability ``min(1, r / q_c)``); on rejection ``r <- norm(max(0, r - q_c))`` and the next
  sibling is tried. q_c is the distribution child c was drawn from: the draft's (sparse) q at the
  parent for siblings drawn i.i.d. from it (SpecInfer-style multi-draft sampling), or one-hot on
  ``d_c`` for deterministic children (a draft's top-k, prompt-lookup candidates), where a rejection
  removes ``d_c`` from r. Both keep every committed token distributed exactly as p.
- greedy requests: the first child whose token is the argmax of the node's row is accepted.

After an acceptance the walk continues at the accepted child with ``r = p_child``. It stops at a
node whose children are all rejected, committing a **recovered** token drawn from the final r by
the exponential race, or at a leaf, committing a **bonus** token drawn from ``p_leaf`` (greedy:
the argmax of the row). A chain is the tree ``parents = [0, 1, .., k-1]``, where this is
``verify_chain``'s rule (the tests check both agree).

The walk is sequential by nature (each acceptance decides which row comes next), so this reference
loops in Python over requests and nodes; it defines semantics, not speed.
"""

from __future__ import annotations

import torch

from kernels.reference.sampling import exponential_race, is_greedy, target_probs


def verify_tree(
    target_logits: torch.Tensor,  # [batch, n+1, vocab], any float dtype; row 0 is the root
    draft_token_ids: torch.Tensor,  # [batch, n] int64, token of node i at index i-1
    parents: torch.Tensor,  # [batch, n] int64, parent of node i at index i-1, in [0, i-1]
    q_ids: torch.Tensor,  # [batch, n, m] int64, support of the distribution node i was drawn from
    q_probs: torch.Tensor,  # [batch, n, m] float, its probabilities on q_ids (padding: 0)
    temperature: torch.Tensor,  # [batch] float
    top_p: torch.Tensor,  # [batch] float
    top_k: torch.Tensor,  # [batch] int
    uniforms: torch.Tensor,  # [batch, n] float on (0, 1], one acceptance test per node
    exponentials: torch.Tensor,  # [batch, vocab] float > 0, Exp(1) draws for the recovered/bonus token
    num_nodes: torch.Tensor | None = None,  # [batch] int64 in [0, n]; None = all n
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verifies a batch of draft trees.

    Returns ``(num_accepted [batch] int64, accepted_nodes [batch, n] int64, next_token [batch]
    int64)``: request b commits the tokens of nodes ``accepted_nodes[b, :num_accepted[b]]`` (a
    root-to-node path; the rest of the row is -1), then ``next_token[b]``.
    """
    batch, n_plus_1, vocab = target_logits.shape
    n = n_plus_1 - 1
    device = target_logits.device
    if num_nodes is None:
        num_nodes = torch.full((batch,), n, dtype=torch.long, device=device)  # [batch]
    p = target_probs(target_logits, temperature, top_p, top_k)  # [batch, n+1, vocab]
    argmax = target_logits.argmax(dim=-1)  # [batch, n+1]
    greedy = is_greedy(temperature)  # [batch]

    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)  # [batch]
    accepted_nodes = torch.full((batch, n), -1, dtype=torch.long, device=device)  # [batch, n]
    next_token = torch.zeros(batch, dtype=torch.long, device=device)  # [batch]
    for b in range(batch):
        size = int(num_nodes[b])
        children: list[list[int]] = [[] for _ in range(size + 1)]  # children[node], in index order
        for node in range(1, size + 1):
            children[int(parents[b, node - 1])].append(node)
        node, r = 0, p[b, 0]  # r: [vocab], the running target distribution at `node`
        while True:
            accepted_child = None
            for child in children[node]:
                token = int(draft_token_ids[b, child - 1])
                if bool(greedy[b]):
                    if token == int(argmax[b, node]):
                        accepted_child = child
                        break
                    continue
                q = torch.zeros(vocab, dtype=torch.float32, device=device)  # [vocab]
                q.scatter_add_(0, q_ids[b, child - 1], q_probs[b, child - 1].float())
                if r[token] > 0 and uniforms[b, child - 1].float() * q[token] <= r[token]:
                    accepted_child = child
                    break
                residual = (r - q).clamp_min(0.0)  # [vocab]
                # All-zero only by rounding when r == q (a rejection then has probability 0).
                if residual.sum() > 0:
                    r = residual / residual.sum()
            if accepted_child is None:
                break
            accepted_nodes[b, num_accepted[b]] = accepted_child
            num_accepted[b] += 1
            node, r = accepted_child, p[b, accepted_child]
        if bool(greedy[b]):
            next_token[b] = argmax[b, node]
        else:
            next_token[b] = exponential_race(r[None], exponentials[b, None].float())[0]
    return num_accepted, accepted_nodes, next_token
