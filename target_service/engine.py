"""The target engine: sessions, forward passes and verification, with no gRPC in sight.

Invariant, for every live session: its KV cache holds exactly ``tokens[:-1]``. Prefill writes the
prompt and samples the first token; every later forward pass (a verify block or a generate step)
feeds the last committed token first, followed by the draft tokens, and afterwards the cache is
cut back to the new ``tokens[:-1]``. So Verify and Generate can alternate freely in one session,
and a stale block is answered without touching anything.

Not thread-safe: the server calls the engine from one dedicated worker thread, which also
serialises the forward passes. Sessions waiting together share a pass: :meth:`TargetEngine.run_batch`
takes a verify block, a decode step or a prompt chunk from each (``target_service.batcher`` gathers
them, ``target_service.ragged`` runs them as one forward), and answers each exactly as it would
be answered alone.

A long prompt is prefilled in chunks of ``prefill_chunk_tokens`` (:class:`PrefillJob`), one pass
per chunk, so the passes of the sessions already decoding run between the chunks instead of
all waiting for the whole prompt. It is also faster on its own: each chunk's attention covers a
[chunk, context] block rather than [prompt, prompt], and the logits agree with one whole-prompt
pass up to float summation order.

This module is the API and the loop of one pass; the work is split by idea:
``target_service.planner`` (each kind of call: its rows, its finish, the commit),
``target_service.runner`` (the forward passes and the scores of their rows),
``target_service.acceptance`` (the tokens taken from the scores) and
``target_service.model_info`` (the model's limits and identity).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from tandem.config import TargetSettings
from tandem.models import LoadedModel, load_model
from tandem.models.tokenizer_facts import TokenizerLoader, tokenizer_facts
from tandem.pass_costs import PassCosts
from tandem.telemetry.metrics import Metrics
from target_service import kv_cache, model_info
from target_service.allowed_tokens import AllowedTokens
from target_service.bad_words import BadWords
from target_service.errors import InvalidArgument
from target_service.grammar import Grammars
from target_service.logit_bias import LogitBias
from target_service.penalties import Penalties
from target_service.planner import Answer, DecodeStep, Planned, Planner, PrefillJob
from target_service.prefix_cache import BUDGET_SHARE, DEFAULT_POSITIONS, PrefixCache
from target_service.runner import ModelRunner
from target_service.session import SamplingTensors, Session, SessionConfig, SessionStore, kv_tokens, make_generator
from target_service.types import (
    DraftBlock,
    FinishReason,
    GenerateResult,
    PrefillResult,
    TargetLoad,
    TokenLogprob,
    Verdict,
    VerdictStatus,
)
from target_service.validation import check_prefill

__all__ = ["Answer", "DecodeStep", "PrefillJob", "TargetEngine"]

PROMPT_LOGPROBS_CHUNK = 64  # prompt rows per pass when each is scored: 64 MB of float32 logits at 262k

log = logging.getLogger(__name__)


class TargetEngine:
    """Owns the target model (through its runner) and every session's committed tokens and KV cache."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        session_ttl_s: float = 600.0,
        max_sessions: int = 256,
        max_context_len: int = 0,
        prefill_chunk_tokens: int = 512,
        max_batched_tokens: int = 64,
        kv_cache_bytes: int = 0,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        screened_head: bool = True,
        prefix_cache: bool = True,
    ) -> None:
        """``kv_cache_bytes``: the memory the sessions' caches may reserve (0 = no budget).
        ``screened_head``: greedy sessions take their tokens from a bfloat16 screen of the LM head
        rescored exactly (``tandem.cpu.screened_head``) where the model and device allow it.
        ``prefix_cache``: a prompt that starts as an ended session's tokens did prefills only the
        rest (``target_service.prefix_cache``)."""
        if prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0, got {prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        if max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {max_batched_tokens}")
        self.max_batched_tokens = max_batched_tokens  # rows of one batched pass (the server's batcher)
        self.device = loaded.device
        self.metrics = metrics
        self.runner = ModelRunner(loaded, screened_head=screened_head, on_broken=self._drop)
        self.vocab_size = self.runner.vocab_size
        log.info(
            "target attention: %s; verifier: %s; short passes: %s",
            self.runner.attention,
            self.runner.verifier.backend,
            "gemma_pass" if self.runner.lean else "the module tree",
        )
        # The tokenizer is loaded only where its facts are not cached or a grammar table is made.
        tokenizer = TokenizerLoader(loaded.hf_dir, loaded.tokenizer)
        facts = tokenizer_facts(tokenizer)
        self.info = model_info.engine_info(loaded, facts, max_context_len, self.runner.verifier.backend)
        text_config = loaded.model.config.get_text_config()
        per_position = kv_cache.bytes_per_position(text_config, next(self.runner.model.parameters()).dtype)
        budget_tokens = max(1, kv_cache_bytes // per_position) if kv_cache_bytes else 0  # 0: no budget
        if kv_cache_bytes:
            log.info(
                "KV cache budget: %.2f GB, %d positions at %d KB each",
                kv_cache_bytes / 2**30,
                budget_tokens,
                per_position // 1024,
            )
        self.store = SessionStore(
            session_ttl_s,
            max_sessions,
            clock,
            on_live_change=self._report_live,
            kv_budget_tokens=budget_tokens,
            prefix_cache=PrefixCache(budget_tokens // BUDGET_SHARE or DEFAULT_POSITIONS) if prefix_cache else None,
        )
        self.planner = Planner(self.store, self.runner, self.info, metrics)
        self.grammars = Grammars(tokenizer, self.vocab_size, self.info.eos_token_ids, facts.fingerprint,
                                 facts.backend)
        self.pass_costs = PassCosts()  # seconds of a pass by its rows, every kind of call's
        self._report_live(0)

    @classmethod
    def from_settings(cls, settings: TargetSettings, metrics: Metrics | None = None) -> TargetEngine:
        """Loads ``settings.target_model`` (HF directory, .gguf or built-in name)."""
        loaded = load_model(settings.target_model, settings.device, settings.dtype, settings.served_model_name,
                            with_tokenizer=False)
        if settings.kv_cache_memory_gb > 0:
            kv_cache_bytes = int(settings.kv_cache_memory_gb * 2**30)
        else:
            kv_cache_bytes = int(kv_cache.AUTO_BUDGET_FRACTION * kv_cache.free_memory_bytes(loaded.device))
        return cls(
            loaded,
            kv_cache_bytes=kv_cache_bytes,
            session_ttl_s=settings.session_ttl_s,
            max_sessions=settings.max_sessions,
            max_context_len=settings.max_context_len,
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
            max_batched_tokens=settings.max_batched_tokens,
            metrics=metrics,
            screened_head=settings.screened_head,
            prefix_cache=settings.prefix_cache,
        )

    # ----------------------------------------------------------------------------- requests

    def prefill(
        self,
        session_id: str,
        prompt_token_ids: Sequence[int],
        config: SessionConfig,
        tokenizer_fingerprint: str = "",
        prompt_logprobs: bool = False,
    ) -> PrefillResult:
        """Creates the session, fills its KV cache with the prompt and picks the first token (in one
        call; the server runs :meth:`begin_prefill` and :meth:`prefill_chunk` as separate calls)."""
        job = self.begin_prefill(session_id, prompt_token_ids, config, tokenizer_fingerprint, prompt_logprobs)
        while (result := self.prefill_chunk(job)) is None:
            pass
        return result

    def begin_prefill(
        self,
        session_id: str,
        prompt_token_ids: Sequence[int],
        config: SessionConfig,
        tokenizer_fingerprint: str = "",
        prompt_logprobs: bool = False,
    ) -> PrefillJob:
        """Checks a prefill request and sets up its session (not yet in the store); no forward pass.
        ``prompt_logprobs``: the result also carries each prompt token's log-probability (after the
        first), for which every prompt row is scored, in chunks of at most
        :data:`PROMPT_LOGPROBS_CHUNK` (their logits are a row of the vocabulary each)."""
        self.check_tokenizer(tokenizer_fingerprint)
        check_prefill(session_id, prompt_token_ids, config, self.vocab_size, self.info.max_context_len)
        self.store.check_can_add(session_id, kv_tokens(len(prompt_token_ids), config))
        generated = prompt_token_ids[len(prompt_token_ids) - config.continued_tokens:]  # output so far, if continued
        # (compiled before, off this thread, by the server: then this is a cache lookup)
        constraint = None if config.grammar is None else self.grammars.constraint(config.grammar, generated)
        penalties = None
        if config.penalized:
            penalties = Penalties(config.presence_penalty, config.frequency_penalty, self.vocab_size, self.device,
                                  generated, repetition=config.repetition_penalty, prompt=prompt_token_ids)
        # A prompt that begins as an ended session's tokens did starts from a copy of their cache;
        # not where every prompt position's hidden state or score is asked for (they are not kept).
        found = None
        if self.store.prefix_cache is not None and not config.return_hidden_states and not prompt_logprobs:
            found = self.store.prefix_cache.lookup(prompt_token_ids)
            # ... or a live session's (a request's other choices, prefilled after the first)
            found = self.store.shared_prefix(prompt_token_ids, at_least=found[1] if found else 0) or found
        cache, cached = found if found is not None else (kv_cache.new_cache(), 0)
        if self.metrics is not None:
            self.metrics.prefix_cache_tokens.labels(outcome="hit").inc(cached)
            self.metrics.prefix_cache_tokens.labels(outcome="prefilled").inc(len(prompt_token_ids) - cached)
        session = Session(
            session_id=session_id,
            config=config,
            prompt_len=len(prompt_token_ids),
            tokens=list(prompt_token_ids),
            cache=cache,
            generator=make_generator(config.seed, self.device),
            sampling=SamplingTensors.of(config, self.device),
            constraint=constraint,
            penalties=penalties,
            logit_bias=LogitBias(config.logit_bias, self.device) if config.logit_bias else None,
            bad_words=BadWords(config.bad_words, self.device) if config.bad_words else None,
            allowed=AllowedTokens(config.allowed_token_ids, self.device) if config.allowed_token_ids else None,
        )
        if prompt_logprobs:
            chunk = min(self.prefill_chunk_tokens or len(prompt_token_ids), PROMPT_LOGPROBS_CHUNK)
            return PrefillJob(session, chunk, prompt_logprobs=True)
        return PrefillJob(session, self.prefill_chunk_tokens, done=cached, cached=cached)

    def prefill_chunk(self, job: PrefillJob) -> PrefillResult | None:
        """Runs the job's next chunk; after the last one the session joins the store (checked again:
        another session may have taken the id or the last slot meanwhile) and the result comes back."""
        return _unwrap(self.run_batch([job])[0])

    def verify(self, block: DraftBlock) -> Verdict:
        """Verifies one draft block against the session and commits the verdict's tokens."""
        return _unwrap(self.run_batch([block])[0])

    def generate(
        self, session_id: str, max_tokens: int = 1, cancelled: Callable[[], bool] = lambda: False
    ) -> GenerateResult:
        """Decodes up to ``max_tokens`` tokens autoregressively, continuing the session.

        ``cancelled`` is asked after each forward pass, before its token is committed: a caller
        that went away while the step ran never sees that token, so it is not committed either.
        A finished session returns no tokens and its finish reason.
        """
        if max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be positive, got {max_tokens}")
        produced: list[int] = []
        logprobs: list[TokenLogprob] = []
        while True:
            result = _unwrap(self.run_batch([DecodeStep(session_id, cancelled)])[0])
            produced += result.token_ids
            logprobs += result.logprobs
            if len(produced) >= max_tokens or result.finish_reason != FinishReason.NONE or not result.token_ids:
                return GenerateResult(
                    tuple(produced), result.committed_len, result.finish_reason, logprobs=tuple(logprobs)
                )

    def run_batch(self, calls: Sequence[DraftBlock | DecodeStep | PrefillJob]) -> list[Answer | Exception]:
        """Runs verify blocks, decode steps and prefill chunks of different sessions in one forward pass.

        Each call gets its own answer, or the error it alone caused (an unknown session, a bad
        block); a forward pass that fails fails every call in it. The answers are what
        :meth:`verify`, one step of :meth:`generate` and :meth:`prefill_chunk` give for each call
        alone: the sessions do not interact, only their rows share the weight reads
        (``target_service.ragged``).
        """
        if len({call.session_id for call in calls}) != len(calls):
            raise ValueError("a batch holds at most one call per session (the second depends on the first)")
        answers: list[Answer | Exception] = [None] * len(calls)
        planned: list[tuple[int, Planned]] = []
        for i, call in enumerate(calls):
            try:
                plan = self.planner.plan(call)
            except Exception as error:  # noqa: BLE001 (this call's own refusal: handed back, the others go on)
                answers[i] = error
                continue
            if isinstance(plan, Planned):
                planned.append((i, plan))
            else:
                answers[i] = plan
        if planned:
            started = time.perf_counter()
            try:
                outputs = self.runner.forward_steps([plan.step for _, plan in planned])
            except Exception as error:  # noqa: BLE001 (the pass failed for all of them)
                for i, _ in planned:
                    answers[i] = error
            else:
                if self.metrics is not None:
                    self.metrics.pass_sessions.observe(len(planned))
                for (i, plan), (scores, hidden) in zip(planned, outputs):
                    try:
                        answers[i] = self.planner.finish(plan, scores, hidden, started)
                    except Exception as error:  # noqa: BLE001
                        answers[i] = error
                rows = sum(len(plan.step.token_ids) for _, plan in planned)
                seconds = time.perf_counter() - started
                self.pass_costs.observe(rows, seconds)
                self._name_the_pass(answers, rows, len(planned), seconds)
        return answers

    def step_seconds(self, sessions_in_pass: int = 0) -> float:
        """What a pass would cost in which every session decodes one token: a row for each live
        session (at least those of the pass just run), priced by the passes measured so far (0
        before any size is known). Under load it is the step the gateway weighs speculation against:
        a decoding step beside speculating sessions waits for their drafts' rows, so the pass it
        shared is not the one it would have with every session decoding (docs/fallback.md#step-time)."""
        estimate = self.pass_costs.estimate(max(1, sessions_in_pass, self.store.live))
        return 0.0 if estimate is None else estimate

    def _name_the_pass(self, answers: list[Answer | Exception], rows: int, sessions: int, seconds: float) -> None:
        """Tells each verdict of a pass its ``rows`` and the tokens it committed, every session's
        share included: a draft prices its own rows against the others' in a shared pass. Verdicts
        and decode steps learn :meth:`step_seconds`, a decode step also its pass's ``seconds``."""
        tokens = sum(_committed(answer) for answer in answers)
        step = self.step_seconds(sessions)
        for i, answer in enumerate(answers):
            if isinstance(answer, Verdict) and answer.status is VerdictStatus.OK:
                answers[i] = dataclasses.replace(answer, pass_rows=rows, pass_tokens=tokens, step_seconds=step)
            elif isinstance(answer, GenerateResult) and answer.token_ids:
                answers[i] = dataclasses.replace(answer, pass_seconds=seconds, step_seconds=step)

    def release(self, session_id: str) -> bool:
        """Frees the session; False when it did not exist."""
        return self.store.release(session_id)

    def expire_idle(self) -> list[str]:
        """Drops sessions idle for longer than the TTL; returns their ids."""
        expired = self.store.expire_idle()
        if expired:
            log.info("expired %d idle session(s)", len(expired))
        return expired

    def load(self, queued_passes: int = 0) -> TargetLoad:
        """The sessions and KV budget in use now (``queued_passes`` comes from the server's batcher).

        Safe to call from the event loop while the model thread works: it only reads counters
        (ints), so a figure may lag a session being added or freed at that moment, nothing worse.
        """
        store = self.store
        capacity = store.kv_budget_tokens
        free = max(0, capacity - store.reserved_kv_tokens) if capacity else 0
        return TargetLoad(store.live, free, capacity, queued_passes)

    def check_tokenizer(self, fingerprint: str) -> None:
        """Refuses a caller whose (non-empty) tokenizer fingerprint differs from the target's."""
        model_info.check_tokenizer(self.info, fingerprint)

    def warmup(self) -> None:
        """One forward pass and one verification, so the first request pays no lazy set-up; and
        the grammar compiler's tokenizer table (a second with a large vocabulary, much of it
        holding the interpreter), so the first constrained request does not stall the others."""
        self.runner.warmup()
        self.grammars.prepare()

    # ----------------------------------------------------------------------------- internals

    def _drop(self, session: Session) -> None:
        """Frees a session whose cache a failed pass may have half-written: it cannot go on correctly
        (and its cache is not kept for later prompts)."""
        session.cache = None
        self.store.release(session.session_id)

    def _report_live(self, live: int) -> None:
        if self.metrics is not None:
            self.metrics.sessions_active.labels(mode="target").set(live)


def _committed(answer: Answer | Exception) -> int:
    if isinstance(answer, Verdict):
        return len(answer.committed_token_ids)
    if isinstance(answer, GenerateResult):
        return len(answer.token_ids)
    return int(isinstance(answer, PrefillResult))  # a prompt's last chunk commits its first token


def _unwrap(answer: Answer | Exception) -> Answer:
    if isinstance(answer, Exception):
        raise answer
    return answer
