"""Greedy tokens from a quantized LM head, scoring only the rows a verdict can reach.

A greedy verification pass feeds k+1 rows, but the verdict (``acceptance.greedy_chain``,
``tree.greedy_path``) reads row i's token only when every draft on the path to row i was accepted:
after the first rejected draft of a chain, its rows are computed for nothing. On a CPU the LM head
is the largest product of a pass (gemma-3-270m: a [262144, 640] weight), and the int8 kernels
multiply at most ``rows_per_sweep`` rows per read of a weight (AVX2: 4, its 16 vector registers):
every further sweep costs the head's arithmetic again. So the head runs in waves. Each wave takes,
for each step, the next rows still reachable (no computed ancestor's token differs from the draft
its child fed), at most one sweep's worth per step, in one call; a row cut off by a rejected draft
is never scored and reads -1, a token no walk compares equal to a draft.

Exact: the kernels compute each row alone (``tandem.quant.modules``: a row's output does not depend
on the rows beside it), so a scored row's logits, soft-capping and argmax are bit for bit what the
whole pass gives it (the same ``GemmaPass.logits``), and the walk reads only rows it reaches, which are scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.rpc.token_tree import ROOT


@dataclass(frozen=True)
class GreedyRows:
    """A greedy step's scored rows: what the head multiplies, and how the rows hang together."""

    hidden: torch.Tensor  # [n, hidden] final hidden states (after the last norm)
    tokens: Sequence[int]  # [n] the token each row fed (row 0: the last committed one)
    parents: Sequence[int]  # [n] each row's parent row, ROOT (-1) for row 0

    @staticmethod
    def of(hidden: torch.Tensor, tokens: Sequence[int], parents: Sequence[int] | None = None) -> GreedyRows:
        """A step's rows; ``parents`` None for a chain (row i follows row i - 1)."""
        return GreedyRows(hidden, tokens, tuple(parents) if parents is not None else (ROOT, *range(len(tokens) - 1)))


class GreedyWaves:
    """Each greedy step's row tokens (``[n]`` int64, -1 where unreachable), the head run in waves."""

    def __init__(
        self,
        head: Callable[[torch.Tensor], torch.Tensor],
        argmax_rows: Callable[[torch.Tensor], torch.Tensor],
        sweep_rows: int,
    ) -> None:
        """``head``: [rows, hidden] -> [rows, vocab] the model's final logits (soft-capped where it
        caps them), each row computed alone; ``argmax_rows``: [rows, vocab] -> [rows] (first index of
        the largest, as torch.argmax); ``sweep_rows``: the rows one read of the head's weight multiplies."""
        self.head = head
        self.argmax_rows = argmax_rows
        self.sweep_rows = max(1, int(sweep_rows))
        self.rows_scored = 0  # over the object's life: rows through the head
        self.rows_skipped = 0  # and rows no verdict could reach

    def __call__(self, steps: Sequence[GreedyRows]) -> list[torch.Tensor]:
        tokens = [[-1] * len(step.tokens) for step in steps]
        scored = [[False] * len(step.tokens) for step in steps]
        while True:
            wave = [self._next_rows(step, choice, done) for step, choice, done in zip(steps, tokens, scored)]
            if not any(wave):
                break
            hidden = torch.cat([step.hidden[rows] for step, rows in zip(steps, wave) if rows])  # [wave rows, hidden]
            logits = self.head(hidden)  # [wave rows, vocab]
            picked = iter(self.argmax_rows(logits).tolist())
            for choice, done, rows in zip(tokens, scored, wave):
                for row in rows:
                    choice[row] = next(picked)
                    done[row] = True
            self.rows_scored += hidden.shape[0]
        self.rows_skipped += sum(done.count(False) for done in scored)
        return [torch.tensor(choice, dtype=torch.long) for choice in tokens]  # [n] each

    def _next_rows(self, step: GreedyRows, choice: list[int], done: list[bool]) -> list[int]:
        """Up to a sweep's worth of the step's unscored rows still reachable, in row order (parents first)."""
        rows = []
        for row in range(len(step.tokens)):
            if not done[row] and self._reachable(step, choice, done, row):
                rows.append(row)
                if len(rows) == self.sweep_rows:
                    break
        return rows

    @staticmethod
    def _reachable(step: GreedyRows, choice: list[int], done: list[bool], row: int) -> bool:
        """No scored ancestor of ``row`` chose another token than the one its child on the path fed."""
        child, parent = row, step.parents[row]
        while parent != ROOT:
            if done[parent] and choice[parent] != step.tokens[child]:
                return False
            child, parent = parent, step.parents[parent]
        return True
