"""The quantized LM head in waves (target_service.greedy_waves): every row a verdict reaches gets
the whole head's argmax, rows past a rejected draft are never scored, and several steps share a wave
(the soft-capped head itself, ``GemmaPass.logits``, is what test_gemma_pass checks the waves through)."""

from __future__ import annotations

import pytest
import torch

from target_service import tree
from target_service.acceptance import greedy_chain
from target_service.greedy_waves import GreedyRows, GreedyWaves

VOCAB = 50


@pytest.fixture
def head():
    """A head (hidden states are their own logits, scaled) that records the rows of each call."""
    calls: list[int] = []

    def product(x: torch.Tensor) -> torch.Tensor:  # [rows, VOCAB] -> [rows, VOCAB]
        calls.append(x.shape[0])
        return 3.0 * x

    product.calls = calls
    return product


def hidden_choosing(head, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), VOCAB] hidden states whose argmax through ``head`` is ``tokens``."""
    hidden = torch.rand(len(tokens), VOCAB, generator=torch.Generator().manual_seed(len(tokens)))
    hidden[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 2.0
    return hidden


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=1)


def test_a_chain_scores_rows_up_to_the_first_rejection_in_sweeps(head) -> None:
    choices = [11, 12, 13, 14, 15, 16, 17, 18]  # the target's choice at each of 8 rows
    waves = GreedyWaves(head, argmax_rows, sweep_rows=3)
    fed = [5, 11, 12, 13, 99, 15, 16, 17]  # drafts 11, 12, 13 accepted, 99 rejected
    (got,) = waves([GreedyRows.of(hidden_choosing(head, choices), fed)])
    # Waves: rows 0-2 (all matched), rows 3-5 (row 3 chose 14, row 4 fed 99): nothing after.
    assert head.calls == [3, 3]
    assert got.tolist() == [11, 12, 13, 14, 15, 16, -1, -1]
    assert greedy_chain(fed[1:], got.tolist()) == greedy_chain(fed[1:], choices) == (3, 14)
    assert (waves.rows_scored, waves.rows_skipped) == (6, 2)


def test_a_fully_accepted_chain_scores_every_row(head) -> None:
    choices = [21, 22, 23, 24, 25]
    waves = GreedyWaves(head, argmax_rows, sweep_rows=2)
    (got,) = waves([GreedyRows.of(hidden_choosing(head, choices), [3, 21, 22, 23, 24])])
    assert got.tolist() == choices and head.calls == [2, 2, 1]


def test_a_tree_scores_only_the_branches_the_walk_can_take(head) -> None:
    # Rows: 0 root; 1 and 2 children of the root (tokens 30, 31); 3 under 1 (32); 4 under 2 (33); 5 under 3 (34).
    parents = (-1, 0, 0, 1, 2, 3)
    fed = [7, 30, 31, 32, 33, 34]
    choices = [31, 40, 33, 41, 42, 43]  # the root chooses 31: row 2's branch; row 2 chooses 33: row 4
    waves = GreedyWaves(head, argmax_rows, sweep_rows=2)
    (got,) = waves([GreedyRows.of(hidden_choosing(head, choices), fed, parents)])
    # Wave 1: rows 0, 1; row 1's branch is dead (the root chose 31), so wave 2: rows 2, 4.
    assert head.calls == [2, 2]
    assert got.tolist() == [31, 40, 33, -1, 42, -1]
    draft_parents = [p - 1 for p in parents[1:]]
    assert tree.greedy_path(fed[1:], draft_parents, got.tolist()) == tree.greedy_path(fed[1:], draft_parents, choices)


def test_steps_share_each_wave(head) -> None:
    a_choices, b_choices = [1, 2, 3, 4, 5, 6], [9]
    a = GreedyRows.of(hidden_choosing(head, a_choices), [0, 1, 2, 3, 4, 5])
    b = GreedyRows.of(hidden_choosing(head, b_choices), [8])
    waves = GreedyWaves(head, argmax_rows, sweep_rows=4)
    got_a, got_b = waves([a, b])
    assert head.calls == [5, 2]  # a's rows 0-3 with b's one row, then a's rows 4-5
    assert got_a.tolist() == a_choices and got_b.tolist() == b_choices


def test_a_step_without_rows_is_answered_empty(head) -> None:
    waves = GreedyWaves(head, argmax_rows, sweep_rows=4)
    (got,) = waves([GreedyRows.of(torch.zeros(0, VOCAB), [])])
    assert got.tolist() == [] and head.calls == []
