"""``tandem calibrate``: how well a draft predicts a target, and the K that pays best.

For each prompt the target continues greedily; one teacher-forced pass then gives the target's
next-token distribution p at every continuation position, and the draft's q at the same positions.
Reported: mean KL(p||q), the acceptance rate alpha = E[sum min(p, q)] and the greedy agreement
P[argmax q = argmax p], the expected tokens per round and speedup for K = 1..max_k (Leviathan et
al. 2023, see ``formulas``), the measured cost of a draft step relative to a target step, and the
best K. Warns when the two models' precisions differ and when KL > 0.8.

Modules: ``formulas`` (the paper's arithmetic), ``compare`` (p against q per position),
``drafts`` (hf / eagle / ngram scorers, precisions, step timing), ``run`` (the run and its
report), ``cli`` (flags and output).
"""

from __future__ import annotations

from tandem.tools.calibrate.cli import add_arguments, main

__all__ = ["add_arguments", "main"]
