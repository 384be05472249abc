"""The target's log-probabilities of the tokens it commits, for sessions that ask for them.

Taken from the logits the token was chosen from (the model's own distribution: the log-softmax of
its logits, before temperature, top-k or top-p), so they are the same whether the token came from a
verified block, a decode step or a prompt's last row. A session that asks for them never takes the
screened greedy head (which yields each row's argmax only); its greedy tokens are the argmax of the
same logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.rpc.types import TokenLogprob


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top: int) -> tuple[TokenLogprob, ...]:
    """Row i of ``logits`` [>= len(token_ids), vocab] scored ``token_ids[i]``: each token's
    log-probability there and the ``top`` most probable tokens of the row (ties: the lower id first)."""
    n = len(token_ids)
    if n == 0:
        return ()
    logp = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, vocab]
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logp.device)  # [n]
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()  # [n]
    if top <= 0:
        return tuple(TokenLogprob(value) for value in chosen)
    values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1, sorted=True)  # [n, top] each
    return tuple(
        TokenLogprob(value, tuple(row_ids), tuple(row_values))
        for value, row_ids, row_values in zip(chosen, indices.tolist(), values.tolist())
    )
