"""Drafts that follow a constrained session's grammar (structured output).

The target masks a constrained session's rows to what its grammar allows
(``target_service.grammar``), so a draft token the grammar forbids is always rejected, and where the
grammar leaves one way on (the punctuation and keys of a JSON schema: ``", "age": ``) the target
can only take it. A :class:`GuidedSession` wraps any proposer session with the same grammar
(``tandem.grammar``): where the text is forced it proposes the forced text's tokens; elsewhere it
proposes what the drafter does, cut where the grammar would refuse it (a chain at its first
forbidden token, a tree's forbidden nodes with their subtrees). Forced drafts are tallied as the
source ``grammar`` by the block-length policy, like any other source.

A guide never changes what the target commits, only what it is offered. It needs the target's
tokenizer, loaded in the background from the service's start (or the first constrained session),
and each grammar compiled, also in the background; until then (or where the tokenizer is not the
target's) sessions are drafted unguided.

Invariant: the matcher has accepted exactly the longest prefix of the session's tokens (generated
part, as ``commit`` says, assumed tokens of blocks sent ahead included) that the grammar allows;
guidance applies only while that is all of them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from draft_service.proposers.base import ProposerSession
from draft_service.types import Proposal, SessionSpec, SparseDist, TargetInfo
from tandem.grammar import GrammarCompiler, GrammarError
from tandem.rpc.types import Grammar, GrammarKind

log = logging.getLogger(__name__)

SOURCE = "grammar"  # the block-length policy's name for a forced draft
MAX_GRAMMARS = 32  # grammars remembered as compiled (their compiled forms: tandem.grammar.CACHE_BYTES)


class _DaemonWorker:
    """One daemon thread running submitted calls in order, started at the first.

    Not a ThreadPoolExecutor: the interpreter joins those at exit, so a draft asked to stop while
    its guide still loads the tokenizer (seconds) would wait for a load nobody needs any more."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[Callable[..., object]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        self._calls.put(lambda: fn(*args))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            call = self._calls.get()
            try:
                call()
            except Exception:  # noqa: BLE001 (the calls log their own failures; never stop the worker)
                log.exception("%s: a background call failed", self._name)


class GrammarGuide:
    """The draft's grammar compiler, for the target's tokenizer (``tokenizer_spec``: the target
    model's SPEC). What it needs of the tokenizer (its facts and the forced-text encoder) loads by
    :meth:`load` as the service starts (else on its one background thread, from :meth:`start` or
    the first constrained session); that thread builds the compiler once the target is known
    (``target``, or :meth:`attach`) and compiles each grammar the first time a session brings it (a
    second or two for a new JSON schema with a large vocabulary): the model thread never waits for
    any of it, and a session whose grammar is not compiled yet drafts unguided."""

    def __init__(self, tokenizer_spec: str, target: TargetInfo | None = None) -> None:
        self._spec = tokenizer_spec
        self._target = target
        # (TokenizerLoader, TokenizerFacts, encoder), once loaded (possibly before the target is known)
        self._loaded: Any = None
        self._compiler: GrammarCompiler | None = None
        self._encode: Callable[[str], Sequence[int]] | None = None  # forced text to tokens (forced_text_encoder)
        self._background = _DaemonWorker("grammar-guide")
        self._lock = threading.Lock()
        self._loading = False
        self._compiled: OrderedDict[tuple[GrammarKind, str], bool] = OrderedDict()  # True: compiled; False: refused
        self._pending: set[tuple[GrammarKind, str]] = set()

    @property
    def ready(self) -> bool:
        return self._compiler is not None

    def wrap(self, session: ProposerSession, spec: SessionSpec) -> ProposerSession:
        """``session`` guided by ``spec.grammar`` where there is one and it is compiled already."""
        if spec.grammar is None:
            return session
        key = (spec.grammar.kind, spec.grammar.spec)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                self._start(key)
                return session
            self._compiled.move_to_end(key)
        if not compiled:
            return session
        start = spec.prompt_len - spec.continued_tokens  # where the grammar's text begins
        # A fresh matcher (from xgrammar's cache): the session follows every token from ``start`` itself.
        matcher = self._compiler.matcher(spec.grammar)
        return GuidedSession(session, matcher, self._encode, start, spec.token_ids)

    def start(self) -> None:
        """Starts loading what the guide needs of the tokenizer (once) in the background."""
        with self._lock:
            self._start_loading()

    def load(self) -> None:
        """Loads what the guide needs of the tokenizer now, on the calling thread (once): the service
        does it as it starts, so that the seconds it holds the interpreter and a core pass before
        the service says it serves, not in its first requests, and no other thread imports
        transformers meanwhile (its lazy modules are not safe to import from two threads at once)."""
        with self._lock:
            if self._loading:
                return
            self._loading = True
        self._load()

    def attach(self, target: TargetInfo) -> None:
        """The target's facts, known once it answers: the compiler is built for them (after the load)."""
        with self._lock:
            self._target = target
            if self._loading:
                self._background.submit(self._build)

    def _start_loading(self) -> None:
        if not self._loading:
            self._loading = True
            self._background.submit(self._load)
            if self._target is not None:
                self._background.submit(self._build)

    def _start(self, key: tuple[GrammarKind, str]) -> None:
        """Queues the tokenizer's loading (once) and ``key``'s compilation (once); under the lock."""
        self._start_loading()
        if key not in self._pending:
            self._pending.add(key)
            self._background.submit(self._compile, key)

    def _load(self) -> None:
        """The tokenizer's facts (from the record the target keeps: tandem.models.tokenizer_facts)
        and the encoder of forced text; the tokenizer itself only where the record or the grammar
        table is not there yet."""
        from tandem.models import resolve
        from tandem.models.tokenizer_facts import TokenizerLoader, tokenizer_facts

        try:
            loader = TokenizerLoader(resolve(self._spec).hf_dir)
            self._loaded = loader, tokenizer_facts(loader), forced_text_encoder(loader)
        except Exception:  # noqa: BLE001 (guidance is an optimisation: say why and draft unguided)
            log.exception("constrained sessions draft unguided: the tokenizer of %r failed to load", self._spec)

    def _build(self) -> None:
        """The compiler for the target (on the background thread, after :meth:`_load`)."""
        target = self._target
        if self._loaded is None or target is None or self._compiler is not None:
            return  # (a failed load was logged)
        loader, facts, encode = self._loaded
        try:
            if facts.fingerprint != target.tokenizer_fingerprint:
                log.warning("constrained sessions draft unguided: the tokenizer of %r is not the target's", self._spec)
                return
            compiler = GrammarCompiler(loader, target.vocab_size, target.eos_token_ids, target.tokenizer_fingerprint,
                                       facts.backend)
            compiler.prepare()
        except Exception:  # noqa: BLE001 (guidance is an optimisation: say why and draft unguided)
            log.exception("constrained sessions draft unguided: the grammar compiler failed to load")
            return
        self._encode, self._compiler = encode, compiler
        log.info("constrained sessions now draft along their grammar")

    def _compile(self, key: tuple[GrammarKind, str]) -> None:
        if self._compiler is None:  # (not loaded: sessions stay unguided)
            return
        try:
            self._compiler.compile(Grammar(*key))
            compiled = True
        except GrammarError as error:  # the target refuses it too
            log.info("unguided: %s", error)
            compiled = False
        with self._lock:
            self._pending.discard(key)
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_GRAMMARS:
                self._compiled.popitem(last=False)


def forced_text_encoder(loader: Any) -> Callable[[str], Sequence[int]]:
    """How a guide spells forced text in tokens: through the checkpoint's ``tokenizer.json`` with
    the tokenizers library alone where there is one (about half the load time of transformers'
    tokenizer class, which may rebuild the backend from the vocabulary in Python), else the
    tokenizer ``loader`` (a ``TokenizerLoader``) loads. A class that spells text otherwise than its
    file only gets its forced drafts accepted less often: the target decides what is committed."""
    path = loader.hf_dir / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        raw = Tokenizer.from_file(str(path))
        return lambda text: raw.encode(text, add_special_tokens=False).ids
    tokenizer = loader.get()
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


class GuidedSession(ProposerSession):
    """A proposer session whose drafts follow the session's grammar."""

    def __init__(self, inner: ProposerSession, matcher: Any, encode: Callable[[str], Sequence[int]], start: int,
                 token_ids: Sequence[int]) -> None:
        """``encode``: forced text to its tokens (:func:`forced_text_encoder`)."""
        self.inner = inner
        self._matcher = matcher
        self._encode = encode
        self._start = start  # index of the grammar's first token in the session's sequence
        self._tokens: list[int] = []  # the session's tokens from ``start`` on
        self._matched = 0  # how many of them the matcher has accepted
        self._follow(list(token_ids[start:]))

    def propose(self, max_tokens: int) -> Proposal:
        if self._matched < len(self._tokens) or max_tokens <= 0:
            return self.inner.propose(max_tokens)  # past a token the grammar refuses: nothing to follow
        forced = self._forced(max_tokens)
        if forced:
            return Proposal(token_ids=tuple(forced), sources=(SOURCE,) * len(forced))
        return self._allowed(self.inner.propose(max_tokens), max_tokens)

    def commit(self, base_len: int, token_ids: Sequence[int], hidden_states: Any = None) -> None:
        self.inner.commit(base_len, token_ids, hidden_states)
        self._follow(self._tokens[: max(0, base_len - self._start)] + list(token_ids))

    def next_tokens(self, n: int) -> tuple[int, ...]:
        if n > 0 and self._matched == len(self._tokens):
            forced = self._forced(1)
            if forced:
                return tuple(forced)
        return self.inner.next_tokens(n)

    def close(self) -> None:
        self.inner.close()

    # ------------------------------------------------------------------------------ internals

    def _follow(self, tokens: list[int]) -> None:
        """The session's tokens (from ``start``) are now ``tokens``: roll back past where they part
        from what was matched, then match as many of the new ones as the grammar allows."""
        same = 0
        while same < min(self._matched, len(tokens)) and self._tokens[same] == tokens[same]:
            same += 1
        if self._matched > same:
            self._matcher.rollback(self._matched - same)
        self._matched, self._tokens = same, tokens
        while self._matched < len(tokens) and not self._matcher.is_terminated():
            if not self._matcher.accept_token(int(tokens[self._matched])):
                break
            self._matched += 1

    def _forced(self, max_tokens: int) -> list[int]:
        """The tokens of the text the grammar forces next (as ``encode`` spells it), as many as it allows."""
        forced = self._accept_forced(max_tokens)
        if forced:
            self._matcher.rollback(len(forced))
        return forced

    def _accept_forced(self, max_tokens: int) -> list[int]:
        """:meth:`_forced`'s tokens, left accepted by the matcher."""
        if max_tokens <= 0 or self._matcher.is_terminated():
            return []
        text = self._matcher.find_jump_forward_string()
        return self._accept(list(self._encode(text))[:max_tokens]) if text else []

    def _accept(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar allows, left accepted by the matcher."""
        taken = 0
        for token in tokens:
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
                break
            taken += 1
        return list(tokens[:taken])

    def _allowed(self, proposal: Proposal, max_tokens: int) -> Proposal:
        """The proposal without what the grammar refuses, then the text the grammar forces after it
        (so the punctuation after a drafted value rides in the same block): a chain up to its first
        forbidden token, a tree without its forbidden nodes and their subtrees (renumbered), the
        forced text under each leaf while the tree has fewer than ``max_tokens`` nodes."""
        if not proposal.parents:
            kept = self._accept(proposal.token_ids)
            forced = self._accept_forced(max_tokens - len(kept))
            if len(kept) + len(forced):
                self._matcher.rollback(len(kept) + len(forced))
            if not forced and len(kept) == len(proposal.token_ids):
                return proposal
            n = len(kept)
            return Proposal(
                token_ids=(*proposal.token_ids[:n], *forced),
                # q of a forced token: certain (the drafter chose it as surely as the grammar does)
                probs=(*proposal.probs[:n], *(SparseDist((t,), (1.0,)) for t in forced)) if proposal.probs else (),
                sources=(*proposal.sources[:n], *(SOURCE,) * len(forced)) if proposal.sources else (),
                shape=proposal.shape,
            )
        kept = self._allowed_nodes(proposal.token_ids, proposal.parents)
        index = {old: new for new, old in enumerate(kept)}
        tokens = [proposal.token_ids[i] for i in kept]
        parents = [-1 if proposal.parents[i] < 0 else index[proposal.parents[i]] for i in kept]
        sources = [proposal.sources[i] for i in kept] if proposal.sources else []
        budget = max_tokens - len(tokens)  # a tree's drafts count, all its nodes, against max_tokens
        for leaf in [i for i in range(len(kept)) if i not in set(parents)]:
            path = [leaf]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            self._accept([tokens[i] for i in reversed(path)])  # allowed: kept nodes' paths are
            forced = self._accept_forced(min(budget, max_tokens - len(path)))
            self._matcher.rollback(len(path) + len(forced))
            for token in forced:
                parents.append(leaf)
                leaf = len(tokens)
                tokens.append(token)
            sources += [SOURCE] * len(forced) if proposal.sources else []
            budget -= len(forced)
        if len(tokens) == len(kept) == len(proposal.token_ids):
            return proposal
        return Proposal(token_ids=tuple(tokens), sources=tuple(sources), parents=tuple(parents), shape=proposal.shape)

    def _allowed_nodes(self, tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
        """The tree's nodes whose whole path the grammar allows, in their order (depth first, with
        the matcher rolled back after each node's subtree)."""
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(parents):
            children.setdefault(parent, []).append(i)
        kept: list[int] = []
        todo: list[tuple[bool, int]] = [(True, i) for i in reversed(children.get(-1, []))]
        while todo:
            visit, i = todo.pop()
            if not visit:
                self._matcher.rollback(1)
            elif not self._matcher.is_terminated() and self._matcher.accept_token(int(tokens[i])):
                kept.append(i)
                todo.append((False, i))
                todo += [(True, child) for child in reversed(children.get(i, []))]
        return sorted(kept)
