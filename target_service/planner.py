"""Each kind of call a forward pass serves, from its rows in the pass to its committed answer.

A call is a prompt chunk (:class:`PrefillJob`), a decode step (:class:`DecodeStep`) or a draft
block (``DraftBlock``: a chain, or a token tree when it names ``draft_parents``).
:meth:`Planner.plan` checks a call and either answers it at once (FINISHED, STALE, a finished
session's empty step) or gives it its rows (a ``runner.Step``); after the pass
:meth:`Planner.finish` hands the rows' scores to the finish method of the call's kind, which takes
the tokens (``target_service.acceptance``) and commits them.

Invariant, for every live session: its KV cache holds exactly ``tokens[:-1]``. Tokens are
committed only through :meth:`Planner._commit`, which cuts the cache back to the new
``tokens[:-1]`` (or finishes the session); a call answered without a pass touches nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tandem.telemetry.metrics import Metrics
from target_service import acceptance, kv_cache, min_p, min_tokens, tree, typical_p
from target_service.logprobs import token_logprobs
from target_service.types import (
    DraftBlock,
    EngineInfo,
    FinishReason,
    GenerateResult,
    PrefillResult,
    TokenLogprob,
    Verdict,
    VerdictStatus,
)
from target_service.errors import InvalidArgument
from target_service.model_info import check_tokenizer
from target_service.runner import ModelRunner, RowScores, Step
from target_service.session import Session, SessionStore
from target_service.validation import check_block

@dataclass
class PrefillJob:
    """A prompt being prefilled chunk by chunk; its session joins the store with the last chunk."""

    session: Session
    chunk_tokens: int  # prompt tokens per pass (0 = the whole prompt)
    done: int = 0  # prompt tokens already in the session's cache
    cached: int = 0  # of them, those copied from the prefix cache (not prefilled)
    hidden: list[torch.Tensor] = field(default_factory=list)  # [chunk, hidden_size] each, when asked for
    prompt_logprobs: bool = False  # score every prompt row, not only the last
    scored: list[TokenLogprob] = field(default_factory=list)  # of the prompt tokens after the first, so far

    @property
    def prompt(self) -> list[int]:
        return self.session.tokens

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def next_chunk(self) -> list[int]:
        """The prompt tokens the next pass feeds."""
        return self.prompt[self.done : self.done + (self.chunk_tokens or len(self.prompt))]


@dataclass(frozen=True)
class DecodeStep:
    """One autoregressive step of a session (a ``Generate`` stream asks for them one at a time)."""

    session_id: str
    # Asked after the pass, before the token is committed: True = the caller went away.
    cancelled: Callable[[], bool] = lambda: False


Call = DraftBlock | DecodeStep | PrefillJob
Answer = Verdict | GenerateResult | PrefillResult | None  # None: a prefill chunk that was not the last


@dataclass(frozen=True)
class Planned:
    """A call given rows in the pass, with what its finish method needs besides their scores."""

    call: Call
    step: Step  # a block's token_ids: [last committed, *drafts]
    parents: list[int] | None = None  # a token tree's draft parents (None: not a tree)


class Planner:
    """Plans each call's rows in a pass and, after it, finishes each call into its answer."""

    def __init__(self, store: SessionStore, runner: ModelRunner, info: EngineInfo, metrics: Metrics | None) -> None:
        self.store = store
        self.runner = runner
        self.info = info
        self.metrics = metrics
        self._eos = frozenset(info.eos_token_ids)

    def plan(self, call: Call) -> Answer | Planned:
        """The call's answer when it needs no pass, else its rows; raises the call's own refusal."""
        if isinstance(call, DraftBlock):
            return self._plan_verify(call)
        if isinstance(call, DecodeStep):
            return self._plan_decode(call)
        return self._plan_prefill_chunk(call)

    def finish(self, planned: Planned, scores: RowScores, hidden: torch.Tensor | None, started: float) -> Answer:
        """The call's answer from its rows' scores and hidden states (``started``: when the pass began)."""
        call = planned.call
        if isinstance(call, PrefillJob):
            return self._finish_prefill_chunk(call, planned.step, scores, hidden)
        if isinstance(call, DecodeStep):
            return self._finish_decode(call, planned.step.session, scores)
        if planned.parents is not None:
            return self._finish_tree(call, planned, scores, hidden, started)
        return self._finish_chain(call, planned.step, scores, hidden, started)

    # ----------------------------------------------------------------------------- planning

    def _plan_prefill_chunk(self, job: PrefillJob) -> Planned:
        session, chunk = job.session, job.next_chunk
        last = job.done + len(chunk) == len(job.prompt)
        want_hidden = session.config.return_hidden_states
        if job.prompt_logprobs:  # every row's logits
            return Planned(job, Step(session, chunk, want_hidden, last_only=False))
        screened = self.runner.screens(session)
        return Planned(job, Step(session, chunk, want_hidden, last_only=True, screened=screened, scored=last))

    def _plan_verify(self, block: DraftBlock) -> Verdict | Planned:
        """Checks a block; a FINISHED or STALE verdict needs no pass, an OK one gets its rows."""
        check_tokenizer(self.info, block.tokenizer_fingerprint)
        check_block(block, self.info.vocab_size)
        session = self.store.get(block.session_id)
        if block.base_len > len(session.tokens):
            raise InvalidArgument(
                f"base_len {block.base_len} is past the {len(session.tokens)} tokens session "
                f"{block.session_id!r} has committed: a block extends a prefix of what was committed"
            )
        # A finished session answers FINISHED to any block, stale or not: the drafter is done.
        if session.finished:
            return Verdict(
                block.block_id, VerdictStatus.FINISHED, session.committed_len, finish_reason=session.finish_reason
            )
        if not _extends(session.tokens, block.base_len, block.assumed_token_ids):
            return Verdict(block.block_id, VerdictStatus.STALE, session.committed_len)
        if block.draft_parents:
            return self._plan_tree(block, session)
        # Draft tokens past the session's budget could never be committed; verifying only the
        # others changes no committed token's distribution (the last one is then a bonus token).
        k = min(len(block.draft_token_ids), session.remaining - 1)
        drafts = list(block.draft_token_ids[:k])
        want_hidden = session.config.return_hidden_states or block.return_hidden_states
        step = Step(session, [session.tokens[-1], *drafts], want_hidden, screened=self.runner.screens(session))
        return Planned(block, step)

    def _plan_tree(self, block: DraftBlock, session: Session) -> Planned:
        """A token tree's pass (``target_service.tree``), greedy or sampled, through the ragged path
        (the only one that attends under a tree mask)."""
        if not self.runner.batched:
            raise InvalidArgument(
                f"this target's attention ({self.runner.attention}) cannot verify token trees; send a chain"
            )
        drafts, parents = tree.within_depth(block.draft_token_ids, block.draft_parents, session.remaining - 1)
        want_hidden = session.config.return_hidden_states or block.return_hidden_states
        step = Step(
            session,
            [session.tokens[-1], *drafts],
            want_hidden,
            screened=self.runner.screens(session),
            tree=tree.forward_parents(parents),
        )
        return Planned(block, step, parents)

    def _plan_decode(self, call: DecodeStep) -> GenerateResult | Planned:
        """A finished session answers with no tokens; a live one gets one row."""
        session = self.store.get(call.session_id)
        if session.finished:
            return GenerateResult((), session.committed_len, session.finish_reason)
        step = Step(session, session.tokens[-1:], False, last_only=True, screened=self.runner.screens(session))
        return Planned(call, step)

    # ----------------------------------------------------------------------------- finishing

    def _finish_prefill_chunk(
        self, job: PrefillJob, step: Step, scores: RowScores, hidden: torch.Tensor | None
    ) -> PrefillResult | None:
        """Scores of the chunk's last row, hidden [chunk, hidden_size] when asked for. After the last
        chunk the session joins the store (checked again: another session may have taken the id or
        the last slot meanwhile) and takes its first token."""
        start = job.done
        job.done += len(step.token_ids)
        if hidden is not None:
            job.hidden.append(hidden)
        if job.prompt_logprobs:  # row i scored prompt token start + i + 1 (the last row: the first token)
            following = job.prompt[start + 1 : job.done + 1]
            job.scored += token_logprobs(scores.logits, following, job.session.config.top_logprobs or 0)
        if job.done < len(job.prompt):
            return None
        session = job.session
        allowed = self._allowed(session, scores if scores.logits is None else RowScores(logits=scores.logits[-1:]))
        first = acceptance.sample(self.runner.verifier, session, allowed, self.info.vocab_size, self.runner.device)
        self.store.add(session)
        committed, reason = self._cut(session, [first])
        self._commit(session, committed, reason)
        hidden_states = torch.cat(job.hidden) if hidden is not None else None  # [prompt, hidden_size]
        logprobs = _logprobs(session, None if scores.logits is None else scores.logits[-1:], committed)  # [1, vocab]
        return PrefillResult(
            first, session.committed_len, reason, hidden_states, logprobs[0] if logprobs else None, job.cached,
            tuple(job.scored),
        )

    def _finish_chain(
        self, block: DraftBlock, step: Step, scores: RowScores, hidden: torch.Tensor | None, started: float
    ) -> Verdict:
        """Scores of k+1 rows, hidden [k+1, hidden]: row i scores the token after [last committed, *drafts][i]."""
        session, drafts = step.session, step.token_ids[1:]
        accepted, next_token = acceptance.accept_chain(
            self.runner.verifier, session, block, drafts, self._allowed(session, scores, drafts),
            self.info.vocab_size, self.runner.device,
        )
        return self._ok_verdict(block, session, len(drafts), drafts[:accepted], next_token, hidden, scores, started)

    def _finish_tree(
        self, block: DraftBlock, planned: Planned, scores: RowScores, hidden: torch.Tensor | None, started: float
    ) -> Verdict:
        """Scores of the 1 + n rows [root, *drafts], hidden [1 + n, hidden]: row i + 1 scores the
        token after draft i's path. The accepted path's cache entries move right after the root."""
        session, drafts = planned.step.session, planned.step.token_ids[1:]
        path, next_token = acceptance.accept_tree(
            self.runner.verifier, session, drafts, planned.parents,
            self._allowed(session, scores, drafts, planned.parents), self.info.vocab_size, self.runner.device,
        )
        tree.keep_path(session.cache, session.committed_len - 1, path)
        rows = [0, *(i + 1 for i in path)]  # the root's and the accepted path's rows
        path_rows = None if hidden is None else hidden[rows]  # [1 + len(path), hidden]
        # [1 + len(path), vocab] where the session has logits
        path_scores = scores if scores.logits is None else RowScores(logits=scores.logits[rows])
        return self._ok_verdict(
            block, session, len(drafts), [drafts[i] for i in path], next_token, path_rows, path_scores, started
        )

    def _finish_decode(self, call: DecodeStep, session: Session, scores: RowScores) -> GenerateResult:
        """The step's token, committed unless its caller went away during the pass."""
        allowed = self._allowed(session, scores)
        token = acceptance.sample(self.runner.verifier, session, allowed, self.info.vocab_size, self.runner.device)
        if call.cancelled():
            kv_cache.truncate(session.cache, session.committed_len - 1)
            return GenerateResult((), session.committed_len, session.finish_reason)
        committed, reason = self._cut(session, [token])
        self._commit(session, committed, reason)
        logprobs = _logprobs(session, scores.logits, committed)
        return GenerateResult(tuple(committed), session.committed_len, session.finish_reason, logprobs=logprobs)

    def _allowed(
        self, session: Session, scores: RowScores, drafts: Sequence[int] = (), parents: Sequence[int] | None = None
    ) -> RowScores:
        """The scores a session's tokens are taken from: its logits without stop tokens where
        ``min_tokens`` holds them back (``target_service.min_tokens``), only its allowed tokens
        (``target_service.allowed_tokens``), without its bad words' last tokens where the rest of
        them comes before (``target_service.bad_words``), biased and penalised at each row
        (``target_service.logit_bias``, ``target_service.penalties``), with what its grammar forbids
        there masked out (``target_service.grammar``) and then what min_p and typical_p drop
        (``target_service.min_p``, ``target_service.typical_p``), where it has them; the scores as
        they are otherwise. Log-probabilities stay the model's own, from the logits before any of these."""
        if not session.reshapes_logits:
            return scores
        logits = scores.logits
        if session.holds_stops:
            stops = set(session.config.stop_token_ids) | (set() if session.config.ignore_eos else set(self._eos))
            logits = min_tokens.masked(logits, session.generated, session.config.min_tokens, stops, parents)
        if session.allowed is not None:
            logits = session.allowed.masked(logits)  # [rows, vocab]
        if session.bad_words is not None:
            output = session.tokens[session.prompt_len - session.config.continued_tokens:]  # the generated text
            logits = session.bad_words.masked(logits, output, drafts, parents)  # [rows, vocab]
        if session.logit_bias is not None:
            logits = session.logit_bias.applied(logits)  # [rows, vocab]
        if session.penalties is not None:
            logits = session.penalties.applied(logits, drafts, parents)  # [rows, vocab]
        if session.constraint is not None:
            logits = session.constraint.masked(logits, drafts, parents, self.runner.mask_rows)
        if session.config.cuts_by_min_p:
            logits = min_p.masked(logits, session.config.temperature, session.config.min_p)  # [rows, vocab]
        if session.config.cuts_by_typical_p:
            logits = typical_p.masked(logits, session.config.temperature, session.config.typical_p)  # [rows, vocab]
        return RowScores(logits=logits)

    # ----------------------------------------------------------------------------- committing

    def _ok_verdict(
        self,
        block: DraftBlock,
        session: Session,
        drafted: int,
        accepted: list[int],
        next_token: int,
        hidden: torch.Tensor | None,
        scores: RowScores,
        started: float,
    ) -> Verdict:
        """Commits a verified block's accepted drafts and next token (cut at a stop or the budget)
        and answers it; ``hidden`` [>= committed, hidden_size] and ``scores`` (logits [>= committed,
        vocab] where the session has them): row j produced the j-th of them."""
        committed, reason = self._cut(session, [*accepted, next_token])
        self._commit(session, committed, reason)
        elapsed = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.verify_duration.observe(elapsed)
            self.metrics.record_round(drafted, len(accepted))
        return Verdict(
            block_id=block.block_id,
            status=VerdictStatus.OK,
            committed_len=session.committed_len,
            num_accepted=min(len(accepted), len(committed)),
            committed_token_ids=tuple(committed),
            finish_reason=reason,
            hidden_states=None if hidden is None else hidden[: len(committed)],
            verify_seconds=elapsed,
            logprobs=_logprobs(session, scores.logits, committed),
        )

    def _cut(self, session: Session, new_tokens: list[int]) -> tuple[list[int], int]:
        """The tokens to commit: up to and including the first stop token, within the budget."""
        for i, token in enumerate(new_tokens):
            if token in session.config.stop_token_ids or (token in self._eos and not session.config.ignore_eos):
                return new_tokens[: i + 1], FinishReason.STOP
            if session.generated + i + 1 >= session.config.max_new_tokens:
                return new_tokens[: i + 1], FinishReason.LENGTH
        return new_tokens, FinishReason.NONE

    def _commit(self, session: Session, new_tokens: list[int], reason: int) -> None:
        """Appends tokens (the grammar's state and the penalties' counts follow) and restores the
        invariant (cache == tokens[:-1]), or finishes."""
        session.tokens.extend(new_tokens)
        if session.constraint is not None:
            session.constraint.advance(new_tokens)
        if session.penalties is not None:
            session.penalties.advance(new_tokens)
        if reason != FinishReason.NONE:
            self.store.finish(session, reason)
        else:
            kv_cache.truncate(session.cache, session.committed_len - 1)


def _logprobs(session: Session, logits: torch.Tensor | None, committed: Sequence[int]) -> tuple[TokenLogprob, ...]:
    """The committed tokens' log-probabilities when the session asked for them (row i of ``logits``
    [>= committed, vocab] scored the i-th); () otherwise."""
    top = session.config.top_logprobs
    if top is None:
        return ()
    if logits is None:  # a runner that scored the rows without logits: a bug, not the caller's fault
        raise RuntimeError(f"session {session.session_id!r} asked for log-probabilities but its rows have no logits")
    return token_logprobs(logits, committed, top)


def _extends(committed: list[int], base_len: int, assumed: Sequence[int]) -> bool:
    """Whether ``committed[:base_len] + assumed`` is exactly the committed sequence."""
    return base_len + len(assumed) == len(committed) and committed[base_len:] == list(assumed)
