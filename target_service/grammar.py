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

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from target_service.errors import InvalidArgument
from target_service.types import Grammar, GrammarKind

log = logging.getLogger(__name__)

ROOT = -1  # a draft whose parent is the root (the last committed token)


class GrammarCompiler:
    """Compiles the grammars sessions ask for, against the target's tokenizer (xgrammar).

    The tokenizer's table (about a second for a vocabulary of 262k) is built at the first grammar;
    compiled grammars are cached by xgrammar, so a schema seen before costs a lookup. Thread-safe:
    the server compiles off the model's thread before the prefill is queued.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar) -> Any:
        """The compiled grammar (an ``xgrammar.CompiledGrammar``); InvalidArgument names what is wrong."""
        compiler = self._get_compiler()
        try:
            if grammar.kind is GrammarKind.JSON_SCHEMA:
                json.loads(grammar.spec)  # a clear error for text that is not JSON at all
                # JSON Schema's own meaning (properties a schema does not forbid are allowed), written
                # compactly: ", " and ": " between items, no other whitespace.
                return compiler.compile_json_schema(grammar.spec, any_whitespace=False, strict_mode=False)
            if grammar.kind is GrammarKind.REGEX:
                return compiler.compile_regex(grammar.spec)
            return compiler.compile_grammar(grammar.spec)
        except Exception as error:  # noqa: BLE001 (xgrammar raises RuntimeError/ValueError for a bad spec)
            message = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise InvalidArgument(f"grammar: this {grammar.kind.value} cannot be compiled: {message[:500]}") from error

    def constraint(self, grammar: Grammar, prompt_token_ids: Sequence[int]) -> Constraint:
        """A matcher for one session, past the prompt's ``grammar.matched_prompt_tokens`` last tokens."""
        import xgrammar

        constraint = Constraint(xgrammar.GrammarMatcher(self.compile(grammar)), self.vocab_size)
        matched = grammar.matched_prompt_tokens
        if matched:
            try:
                constraint.advance(prompt_token_ids[-matched:])
            except RuntimeError:
                raise InvalidArgument(f"grammar: the prompt's last {matched} tokens (matched_prompt_tokens) are "
                                      "not text the grammar allows") from None
        return constraint

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                started = time.perf_counter()
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._eos
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
                log.info("grammar compiler ready in %.2f s (vocabulary %d)", time.perf_counter() - started,
                         self.vocab_size)
            return self._compiler


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

    def masked(self, logits: torch.Tensor, drafts: Sequence[int] = (), parents: Sequence[int] | None = None
               ) -> torch.Tensor:
        """A copy of ``logits`` [rows, vocab] with the tokens the grammar forbids at -inf: row 0 after
        the committed tokens, row i + 1 after draft i's path (``parents``: each draft's parent, an
        earlier draft's index or ``ROOT``; None: a chain). Rows past 1 + len(drafts) are left as
        they are (there are none but row 0 in a prefill or decode step)."""
        import xgrammar

        rows = min(logits.shape[0], 1 + len(drafts))
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
        out = logits.clone()
        xgrammar.apply_token_bitmask_inplace(out[:rows], bitmask.to(out.device), vocab_size=self.vocab_size)
        return out
