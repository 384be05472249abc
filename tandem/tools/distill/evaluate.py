"""Held-out agreement of a draft with the target, measured the same way for both kinds.

``hits[s, t, j-1]`` says whether the draft's j-th token drafted from start position t of held-out
sequence s equals the target's argmax at position t+j. Two numbers come out of it:

- one-step agreement: hits at j=1 over every start, teacher-forced (the issue's measure; also
  reported on held-out Python code alone);
- rollout acceptance for K=1..5: the fraction of windows whose first k drafted tokens are all the
  target's choices. Only windows along which the sequence follows the target's own greedy choices
  count (the target's generations, and offline text where it happens to agree), because only
  there are the draft's inputs what a greedy session would feed it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tandem.tools.distill.store import SOURCES


@dataclass
class Agreement:
    one_step: float  # all held-out positions
    one_step_code: float  # held-out Python standard-library code only
    one_step_generated: float  # the target's held-out greedy generations only
    rollout: list[float]  # acceptance of the first k drafted tokens, k = 1..K
    mean_accepted: float  # expected accepted tokens per round of K (sum of rollout)
    positions: int
    windows: int

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()} | {
            "rollout": [round(v, 4) for v in self.rollout]}


def summarize(hits: torch.Tensor, data: dict[str, torch.Tensor]) -> Agreement:
    """hits: [seqs, n, K] bool with n = seq_len - K; data: the held-out split of the feature store."""
    _seqs, n, steps = hits.shape
    valid = data["valid"].bool()  # [seqs, L]
    argmax = data["topk_ids"][..., 0].long()  # [seqs, L]
    tokens = data["tokens"].long()
    first = valid[:, 1 : n + 1]  # [seqs, n]: step 1 of start t compares at t+1
    code = (data["source"] == SOURCES.index("stdlib"))[:, None] & first
    generated = data["generated"].bool()[:, 1 : n + 1] & first

    def rate(mask: torch.Tensor) -> float:
        return float(hits[..., 0][mask].float().mean()) if mask.any() else 0.0

    follows = torch.zeros_like(valid)
    follows[:, :-1] = (tokens[:, 1:] == argmax[:, :-1]) & valid[:, 1:]  # the next token is the target's choice
    eligible = valid[:, steps : steps + n].clone()  # [seqs, n]: all K compared positions are real
    for j in range(steps):  # inputs x_{t+1..t+K} are the target's own choices
        eligible &= follows[:, j : j + n]
    accepted = torch.cumprod(hits.float(), dim=-1)[eligible]  # [windows, K]
    rollout = accepted.mean(0).tolist() if accepted.shape[0] else [0.0] * steps
    return Agreement(
        one_step=rate(first), one_step_code=rate(code), one_step_generated=rate(generated),
        rollout=rollout, mean_accepted=float(sum(rollout)), positions=int(first.sum()), windows=int(eligible.sum()),
    )
