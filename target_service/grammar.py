"""Structured output: the rows of a constrained session scored only over the tokens its grammar allows.

A session whose ``SessionParams.grammar`` is set owns a :class:`Constraint`, a grammar matcher
(xgrammar's) advanced by every token the session commits. Before the target takes tokens from a
pass's scores, :meth:`Constraint.masked` sets to -inf every token the grammar does not allow at
each row: row 0 after the committed tokens, row i + 1 after draft i's path (a chain is a tree whose
draft i has parent i - 1). So greedy rows take the allowed argmax, and sampled rows the target's
distribution renormalised over the allowed tokens, speculative or not: a draft token the grammar
forbids has probability 0 there and is rejected like any other the target would not choose.

Invariant: the matcher has accepted exactly the session's generated tokens. Masks are filled by
walking the tree depth first (accept a draft, fill its row, visit its children, roll back); a row
below a draft the grammar forbids, or below an end of sequence, keeps every token allowed, since no
walk can reach it.

End of sequence is allowed only where the text is complete, and once it is complete only end of
sequence is, so a constrained session stops as soon as its text is whole (it cannot ignore EOS).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tandem.grammar import GrammarCompiler, GrammarError
from target_service.errors import InvalidArgument
from target_service.types import Grammar

ROOT = -1  # a draft whose parent is the root (the last committed token)

# (logits [rows, vocab] float32, bitmask [rows, vocab / 32] int32) -> logits with what is not allowed at -inf
MaskRows = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Grammars:
    """The target's grammar compiler (``tandem.grammar``), its refusals as InvalidArgument."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 fingerprint: str | None = None, backend: str | None = None) -> None:
        """``tokenizer``: the tokenizer or a ``TokenizerLoader`` (``tandem.grammar.GrammarCompiler``)."""
        self._compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids, fingerprint, backend)
        self.vocab_size = vocab_size

    def prepare(self) -> None:
        """Builds the tokenizer's table now (``tandem.grammar.GrammarCompiler.prepare``)."""
        self._compiler.prepare()

    def compile(self, grammar: Grammar) -> None:
        """Compiles ``grammar`` (kept in the cache for the session's prefill) or refuses it; the
        server calls this off the model's thread."""
        try:
            self._compiler.compile(grammar)
        except GrammarError as error:
            raise InvalidArgument(str(error)) from None

    def constraint(self, grammar: Grammar, generated: Sequence[int] = ()) -> Constraint:
        """A session's constraint, past ``generated`` (the prompt's continued tokens)."""
        try:
            return Constraint(self._compiler.matcher(grammar, generated), self.vocab_size)
        except GrammarError as error:
            raise InvalidArgument(str(error)) from None


class Constraint:
    """One session's grammar state: which tokens each scored row allows."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def advance(self, tokens: Sequence[int]) -> None:
        """Accepts newly committed tokens (each was allowed where it was chosen)."""
        for token in tokens:
            if not self._matcher.accept_token(int(token)):
                raise RuntimeError(f"committed token {token} is not one the session's grammar allowed")

    def masked(
        self,
        logits: torch.Tensor,
        drafts: Sequence[int] = (),
        parents: Sequence[int] | None = None,
        mask_rows: MaskRows | None = None,
    ) -> torch.Tensor:
        """A copy of ``logits`` [1 + len(drafts), vocab] with the tokens the grammar forbids at -inf:
        row 0 after the committed tokens, row i + 1 after draft i's path (``parents``: each draft's
        parent, an earlier draft's index or ``ROOT``; None: a chain). ``mask_rows``: the native op
        that applies the bitmask (``decoder_ops.cpp``) where the runner has it, else xgrammar's."""
        import xgrammar

        rows = 1 + len(drafts)
        if logits.shape[0] != rows:
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(drafts)} drafts")
        bitmask = xgrammar.allocate_token_bitmask(rows, self.vocab_size)  # [rows, vocab / 32] int32, all allowed
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        if parents is None:
            parents = [i - 1 if i else ROOT for i in range(len(drafts))]
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(parents[: rows - 1]):
            children.setdefault(parent, []).append(i)
        # Depth first without recursion: ("visit", i) accepts draft i, fills its row and queues its
        # children; ("leave", i) rolls the matcher back past it.
        todo: list[tuple[str, int]] = [("visit", i) for i in reversed(children.get(ROOT, []))]
        while todo:
            action, i = todo.pop()
            if action == "leave":
                self._matcher.rollback(1)
            elif self._matcher.accept_token(int(drafts[i])):
                todo.append(("leave", i))
                if not self._matcher.is_terminated():  # (after end of sequence the session has ended)
                    self._matcher.fill_next_token_bitmask(bitmask, i + 1)
                    todo += [("visit", child) for child in reversed(children.get(i, []))]
        bitmask = bitmask.to(logits.device)
        if mask_rows is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            return mask_rows(logits, bitmask)
        out = logits.clone()
        xgrammar.apply_token_bitmask_inplace(out, bitmask, vocab_size=self.vocab_size)
        return out
