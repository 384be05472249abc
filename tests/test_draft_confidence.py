"""benchmarks/draft_confidence.py: positions by the target's confidence, and who agrees there."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

_benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.append(str(_benchmarks))  # the script imports draft_replay beside it
_spec = importlib.util.spec_from_file_location("draft_confidence", _benchmarks / "draft_confidence.py")
draft_confidence = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(draft_confidence)

VOCAB = 4


def test_copying_takes_the_longest_suffix_at_its_latest_earlier_occurrence() -> None:
    assert draft_confidence.copied([5, 6, 7, 5, 6]) == 7
    assert draft_confidence.copied([1, 2, 1, 3, 1]) == 3  # [1] last seen before at index 2
    assert draft_confidence.copied([9, 1, 2, 8, 1, 2, 4, 2]) == 4  # [2]: the latest, not [1, 2]'s
    assert draft_confidence.copied([8, 1, 2, 9, 1, 2]) == 9  # [1, 2] beats [2]
    assert draft_confidence.copied([1, 2, 3]) is None


class NextTokenDrafter:
    """Guesses token + 1 (mod VOCAB) after any token, whatever the feature."""

    vocab_ids = torch.arange(VOCAB)

    def step(self, feature: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.one_hot((token_ids + 1) % VOCAB, VOCAB).float()  # [b, VOCAB]
        return feature, logits


def run(ids: list[int], prompt_len: int, confidence: float) -> dict:
    """Hidden rows whose next-token distribution (through an identity LM head) puts ``confidence``
    on the text's actual next token."""
    spread = torch.log(torch.tensor((1 - confidence) / (VOCAB - 1)))
    hidden = torch.full((len(ids), VOCAB), float(spread))  # [seq, VOCAB]
    for t in range(len(ids) - 1):
        hidden[t, ids[t + 1]] = torch.log(torch.tensor(confidence))
    return {"domain": "prose", "prompt_len": prompt_len, "ids": ids, "hidden": hidden}


def test_each_generated_position_is_counted_once_in_its_band_with_who_agreed() -> None:
    counting = [0, 1, 2, 3, 0, 1, 2, 3]  # every token is the previous + 1: the drafter is always right
    runs = [run(counting, 2, 0.95), run([0, 1, 3, 2, 0, 1], 2, 0.3)]
    counts = draft_confidence.tally(runs, NextTokenDrafter(), torch.eye(VOCAB))["prose"]
    confident, ties = counts["p_max 0.9-1.0"], counts["p_max 0.0-0.5"]
    # Positions t = prompt_len - 1 .. len - 3 (the head's first draft, from t, is for t + 2): 5 and 3.
    assert (confident["positions"], ties["positions"], counts["all"]["positions"]) == (5, 3, 8)
    assert confident["head_top1"] == confident["head_top4"] == 5
    assert confident["copy"] == 3  # the second 0, 1, 2, 3 repeats the first, from its second token on
    # [0, 1, 3, 2, 0, 1]: the drafter's 0 after 3 and 3 after 2 are wrong, 1 after 0 right; its four
    # guesses hold every token of this vocabulary; copying finds only the last 1 (after the first 0).
    assert (ties["head_top1"], ties["head_top4"], ties["copy"]) == (1, 3, 1)
    assert counts["all"]["head_top1"] == 6
