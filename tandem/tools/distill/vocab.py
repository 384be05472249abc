"""The reduced vocabulary: the target tokens a draft can propose, chosen by how often the target picks them.

A draft proposes only tokens in this set; every draft step multiplies by one head row per member,
so the set trades draft-time cost (rows x hidden per step) against coverage (how often the target's
choice is in the set at all: a choice outside it is always rejected). Index 0 is reserved for the
target's unk (else pad) token, because target ids outside the set are fed to a standalone draft
as reduced index 0.
"""

from __future__ import annotations

import torch


def choose_vocab(choices: torch.Tensor, target_vocab: int, size: int, first: int, specials: list[int]) -> torch.Tensor:
    """choices: [m] target ids (the target's argmax picks) -> vocab_ids [min(size, target_vocab)] int64.

    Order: ``first`` (unk/pad), the other specials, then the most frequent choices; ties and the
    rest (when the corpus picks fewer distinct tokens than ``size``) by ascending id.
    """
    size = min(size, target_vocab)
    counts = torch.bincount(choices.long().flatten(), minlength=target_vocab).double()  # [vocab]
    counts -= torch.arange(target_vocab, dtype=torch.float64) / (2.0 * target_vocab)  # tie-break: lower id first
    pinned = [first] + [s for s in dict.fromkeys(specials) if s is not None and s != first and 0 <= s < target_vocab]
    counts[pinned] = float("-inf")
    rest = torch.topk(counts, size - len(pinned)).indices
    return torch.cat([torch.tensor(pinned, dtype=torch.int64), rest.to(torch.int64)])


def reduced_index(vocab_ids: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """[target_vocab] int64: target id -> reduced index, -1 when the id is not in the set."""
    table = torch.full((target_vocab,), -1, dtype=torch.int64)
    table[vocab_ids] = torch.arange(vocab_ids.numel(), dtype=torch.int64)
    return table


def coverage(vocab_ids: torch.Tensor, choices: torch.Tensor, target_vocab: int) -> float:
    """Fraction of the target's choices (e.g. held-out argmax ids) that the set contains."""
    if choices.numel() == 0:
        return 0.0
    inside = reduced_index(vocab_ids, target_vocab)[choices.long()] >= 0
    return float(inside.float().mean())


def coverage_curve(train_choices: torch.Tensor, heldout_choices: torch.Tensor, target_vocab: int,
                   sizes: tuple[int, ...] = (2048, 4096, 8192, 12288, 16384, 24576, 32768)) -> dict[str, float]:
    """Held-out coverage of a frequency-ranked set of each size (to pick --reduced-vocab)."""
    out = {}
    for size in sizes:
        if size <= target_vocab:
            ids = choose_vocab(train_choices, target_vocab, size, first=0, specials=[])
            out[str(size)] = round(coverage(ids, heldout_choices, target_vocab), 5)
    return out
