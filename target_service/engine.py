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
all waiting for the whole prompt (gemma-3-270m on 2 CPU cores: 37 s for 8192 tokens in one pass).
It is also faster on its own: each chunk's attention covers a [chunk, context] block rather than
[prompt, prompt] (8192 tokens: 26 s in chunks of 512), and the logits are the same (chunks of 512
give bitwise the same next-token logits for a 1500-token prompt; other sizes differ by ~1e-5).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kernels.hf_attention import install_on_cuda
from kernels.reference import draw_exponentials, draw_uniforms, is_greedy
from tandem.config import TargetSettings
from tandem.telemetry.metrics import Metrics
from tandem.models import LoadedModel, load_model, tokenizer_fingerprint
from tandem.quant.modules import int8_activations
from tandem.cpu.screened_head import ScreenedArgmax, screened_argmax_for
from tandem.v1 import common_pb2
from target_service import gemma_pass, kv_cache, ragged, tree
from target_service.api import (
    FINISHED,
    NOT_FINISHED,
    OK,
    STALE,
    DraftBlock,
    EngineInfo,
    GenerateResult,
    PrefillResult,
    Verdict,
)
from target_service.errors import InvalidArgument, TokenizerMismatch
from target_service.session import (
    SamplingTensors,
    Session,
    SessionConfig,
    SessionStore,
    kv_tokens,
    make_generator,
)
from target_service.validation import check_block, check_prefill
from target_service.verifier import select_verifier

log = logging.getLogger(__name__)

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH


@dataclass
class PrefillJob:
    """A prompt being prefilled chunk by chunk; its session joins the store with the last chunk."""

    session: Session
    chunk_tokens: int  # prompt tokens per pass (0 = the whole prompt)
    done: int = 0  # prompt tokens already in the session's cache
    hidden: list[torch.Tensor] = field(default_factory=list)  # [chunk, hidden_size] each, when asked for

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


Answer = Verdict | GenerateResult | PrefillResult | None  # None: a prefill chunk that was not the last


@dataclass(frozen=True)
class DecodeStep:
    """One autoregressive step of a session (a ``Generate`` stream asks for them one at a time)."""

    session_id: str
    # Asked after the pass, before the token is committed: True = the caller went away.
    cancelled: Callable[[], bool] = lambda: False


@dataclass(frozen=True)
class RowScores:
    """What the LM head gave a step's scored rows: their logits, or for a greedy session whose
    head is screened (``tandem.cpu.screened_head``) only each row's argmax, all greedy decoding uses
    (neither for a step that scores no rows)."""

    logits: torch.Tensor | None = None  # [rows, vocab]
    argmax: torch.Tensor | None = None  # [rows] int64


@dataclass
class _Step:
    """A session's rows in a forward pass, and what to do with their outputs."""

    session: Session
    token_ids: list[int]  # fed after the session's cache: its last committed token, then any drafts
    want_hidden: bool
    finish: Callable[[RowScores, torch.Tensor | None, float], Answer]
    last_only: bool = False  # scores of the last row only (a prefill chunk, a decode step)
    screened: bool = False  # argmax only, through the engine's screened head (greedy sessions)
    scored: bool = True  # False: no scores at all (a prompt chunk before the last)
    tree: tuple[int, ...] | None = None  # token_ids as a token tree (target_service.tree.forward_parents)

    @property
    def no_logits(self) -> bool:
        """The LM head's float32 product is not needed: screened rows, or none scored."""
        return self.screened or not self.scored

    @property
    def needs_hidden(self) -> bool:
        """The pass must return this step's final hidden states: asked for, or to be screened."""
        return self.want_hidden or (self.screened and self.scored)


RAGGED_LONE_MAX_ROWS = 16  # a longer lone step (a prompt chunk) keeps transformers' causal SDPA path


class TargetEngine:
    """Owns the target model and every session's committed tokens and KV cache."""

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
    ) -> None:
        """``kv_cache_bytes``: the memory the sessions' caches may reserve (0 = no budget).
        ``screened_head``: greedy sessions take their tokens from a bfloat16 screen of the LM head
        rescored exactly (``tandem.cpu.screened_head``) where the model and device allow it."""
        if prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0, got {prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        if max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {max_batched_tokens}")
        self.max_batched_tokens = max_batched_tokens  # rows of one batched pass (the server's batcher)
        self.model = loaded.model
        self.device = loaded.device
        # On CUDA the model's attention becomes the Triton tree-attention kernel (a chain by default);
        # on every device it also learns to run several sessions in one pass (run_batch).
        install_on_cuda(self.model, loaded.device)
        self.batched = ragged.install(self.model) is not None  # else run_batch runs its sessions one by one
        self.attention = self.model.config._attn_implementation
        self.metrics = metrics
        text_config = loaded.model.config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        # Past the sliding window a lone decode or verify step is cheaper through the ragged path
        # over SDPA: its sliding layers read only the window's keys, where transformers' mask makes
        # them read every key (gemma-3-270m, 2-core CPU, 4000 positions: a decode step 32 against
        # 43 ms, a 4-token verify 38 against 55 ms; the same below the window). Tandem's own tree
        # attention (CUDA) applies the window itself, so there lone steps keep the ordinary path.
        sdpa = self.attention == ragged.PREFIX + "sdpa"
        self.ragged_after = _sliding_window(text_config) if sdpa else None
        # int8 activations turn a multi-row pass's rounding noise into changed tokens: then every
        # short pass, a decode step included, runs through ragged.forward attending row by row.
        self.row_exact = sdpa and int8_activations(self.model)
        # A quantized Gemma 3 runs ragged passes without transformers' module tree (gemma_pass): a
        # lone short step is then cheaper through ragged.forward whatever its kernel.
        self.lean = self.batched and sdpa and gemma_pass.for_model(self.model) is not None
        self.verifier = select_verifier(loaded.device)
        self.greedy_head: ScreenedArgmax | None = (
            screened_argmax_for(self.model, loaded.device) if screened_head else None
        )
        log.info("target attention: %s; verifier: %s; short passes: %s", self.attention, self.verifier.backend,
                 "gemma_pass" if self.lean else "the module tree")
        self.info = EngineInfo(
            model_name=loaded.name,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
            dtype=loaded.weights,
            device=loaded.device,
            max_context_len=_context_len(text_config, max_context_len),
            eos_token_ids=_eos_token_ids(loaded, self.vocab_size),
            hidden_size=int(text_config.hidden_size),
            verifier_backend=self.verifier.backend,
        )
        self._eos = frozenset(self.info.eos_token_ids)
        per_position = kv_cache.bytes_per_position(text_config, next(self.model.parameters()).dtype)
        budget_tokens = max(1, kv_cache_bytes // per_position) if kv_cache_bytes else 0  # 0: no budget
        if kv_cache_bytes:
            log.info(
                "KV cache budget: %.2f GB, %d positions at %d KB each",
                kv_cache_bytes / 2**30,
                budget_tokens,
                per_position // 1024,
            )
        self.store = SessionStore(
            session_ttl_s, max_sessions, clock, on_live_change=self._report_live, kv_budget_tokens=budget_tokens
        )
        self._report_live(0)

    @classmethod
    def from_settings(cls, settings: TargetSettings, metrics: Metrics | None = None) -> TargetEngine:
        """Loads ``settings.target_model`` (HF directory, .gguf or built-in name)."""
        loaded = load_model(settings.target_model, settings.device, settings.dtype, settings.served_model_name)
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
        )

    # ----------------------------------------------------------------------------- requests

    def prefill(
        self,
        session_id: str,
        prompt_token_ids: Sequence[int],
        config: SessionConfig,
        tokenizer_fingerprint: str = "",
    ) -> PrefillResult:
        """Creates the session, fills its KV cache with the prompt and picks the first token (in one
        call; the server runs :meth:`begin_prefill` and :meth:`prefill_chunk` as separate calls)."""
        job = self.begin_prefill(session_id, prompt_token_ids, config, tokenizer_fingerprint)
        while (result := self.prefill_chunk(job)) is None:
            pass
        return result

    def begin_prefill(
        self,
        session_id: str,
        prompt_token_ids: Sequence[int],
        config: SessionConfig,
        tokenizer_fingerprint: str = "",
    ) -> PrefillJob:
        """Checks a prefill request and sets up its session (not yet in the store); no forward pass."""
        self.check_tokenizer(tokenizer_fingerprint)
        check_prefill(session_id, prompt_token_ids, config, self.vocab_size, self.info.max_context_len)
        self.store.check_can_add(session_id, kv_tokens(len(prompt_token_ids), config))
        session = Session(
            session_id=session_id,
            config=config,
            prompt_len=len(prompt_token_ids),
            tokens=list(prompt_token_ids),
            cache=kv_cache.new_cache(),
            generator=make_generator(config.seed, self.device),
            sampling=SamplingTensors.of(config, self.device),
        )
        return PrefillJob(session, self.prefill_chunk_tokens)

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
        while True:
            result = _unwrap(self.run_batch([DecodeStep(session_id, cancelled)])[0])
            produced += result.token_ids
            if len(produced) >= max_tokens or result.finish_reason != NOT_FINISHED or not result.token_ids:
                return GenerateResult(tuple(produced), result.committed_len, result.finish_reason)

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
        steps: list[tuple[int, _Step]] = []
        for i, call in enumerate(calls):
            try:
                if isinstance(call, DraftBlock):
                    planned = self._plan_verify(call)
                elif isinstance(call, DecodeStep):
                    planned = self._plan_decode(call)
                else:
                    planned = self._plan_prefill_chunk(call)
            except Exception as error:  # noqa: BLE001 (this call's own refusal: handed back, the others go on)
                answers[i] = error
                continue
            if isinstance(planned, _Step):
                steps.append((i, planned))
            else:
                answers[i] = planned
        if steps:
            started = time.perf_counter()
            try:
                outputs = self._forward_steps([step for _, step in steps])
            except Exception as error:  # noqa: BLE001 (the pass failed for all of them)
                for i, _ in steps:
                    answers[i] = error
            else:
                if self.metrics is not None:
                    self.metrics.pass_sessions.observe(len(steps))
                for (i, step), (scores, hidden) in zip(steps, outputs):
                    try:
                        answers[i] = step.finish(scores, hidden, started)
                    except Exception as error:  # noqa: BLE001
                        answers[i] = error
        return answers

    def _plan_prefill_chunk(self, job: PrefillJob) -> _Step:
        session, chunk = job.session, job.next_chunk
        last = job.done + len(chunk) == len(job.prompt)

        def finish(scores: RowScores, hidden: torch.Tensor | None, started: float) -> PrefillResult | None:
            # scores of the chunk's last row, hidden [chunk, hidden_size] when asked for
            job.done += len(chunk)
            if hidden is not None:
                job.hidden.append(hidden)
            if not last:
                return None
            first = self._sample(session, scores)
            self.store.add(session)
            committed, reason = self._cut(session, [first])
            self._commit(session, committed, reason)
            hidden_states = torch.cat(job.hidden) if hidden is not None else None  # [prompt, hidden_size]
            return PrefillResult(first, session.committed_len, reason, hidden_states)

        want_hidden = session.config.return_hidden_states
        screened = self._screened(session)
        return _Step(session, chunk, want_hidden, finish, last_only=True, screened=screened, scored=last)

    def _plan_verify(self, block: DraftBlock) -> Verdict | _Step:
        """Checks a block; a FINISHED or STALE verdict needs no pass, an OK one gets its rows."""
        self.check_tokenizer(block.tokenizer_fingerprint)
        check_block(block, self.vocab_size)
        session = self.store.get(block.session_id)
        # A finished session answers FINISHED to any block, stale or not: the drafter is done.
        if session.finished:
            return Verdict(block.block_id, FINISHED, session.committed_len, finish_reason=session.finish_reason)
        if not _extends(session.tokens, block.base_len, block.assumed_token_ids):
            return Verdict(block.block_id, STALE, session.committed_len)
        if block.draft_parents:
            return self._plan_tree(block, session)
        # Draft tokens past the session's budget could never be committed; verifying only the
        # others changes no committed token's distribution (the last one is then a bonus token).
        k = min(len(block.draft_token_ids), session.remaining - 1)
        drafts = list(block.draft_token_ids[:k])

        def finish(scores: RowScores, hidden: torch.Tensor | None, started: float) -> Verdict:
            # scores of k+1 rows, hidden [k+1, hidden]: row i scores the token after [last committed, *drafts][i].
            if scores.argmax is not None:
                accepted, next_token = _greedy_chain(drafts, scores.argmax.tolist())
            else:
                accepted, next_token = self._verify_chain(session, block, drafts, scores.logits)
            return self._ok_verdict(block, session, k, drafts[:accepted], next_token, hidden, started)

        want_hidden = session.config.return_hidden_states or block.return_hidden_states
        return _Step(session, [session.tokens[-1], *drafts], want_hidden, finish, screened=self._screened(session))

    def _plan_tree(self, block: DraftBlock, session: Session) -> _Step:
        """A token tree's pass (``target_service.tree``): greedy sessions only, through the ragged
        path (the only one that attends under a tree mask)."""
        if not bool(is_greedy(session.sampling.temperature)[0]):
            raise InvalidArgument(
                "a token tree (draft_parents) is verified greedily; this session samples (send a chain)"
            )
        if not self.batched:
            raise InvalidArgument(f"this target's attention ({self.attention}) cannot verify token trees; send a chain")
        drafts, parents = tree.within_depth(block.draft_token_ids, block.draft_parents, session.remaining - 1)

        def finish(scores: RowScores, hidden: torch.Tensor | None, started: float) -> Verdict:
            # scores of the 1 + n rows [root, *drafts], hidden [1 + n, hidden]: row i + 1 scores
            # the token after draft i's path
            choices = scores.argmax if scores.argmax is not None else scores.logits.argmax(dim=-1)  # [1 + n]
            path, next_token = tree.greedy_path(drafts, parents, choices.tolist())
            tree.keep_path(session.cache, session.committed_len - 1, path)
            path_rows = None if hidden is None else hidden[[0, *(i + 1 for i in path)]]  # [1 + len(path), hidden]
            return self._ok_verdict(
                block, session, len(drafts), [drafts[i] for i in path], next_token, path_rows, started
            )

        want_hidden = session.config.return_hidden_states or block.return_hidden_states
        return _Step(
            session, [session.tokens[-1], *drafts], want_hidden, finish, screened=self._screened(session),
            tree=tree.forward_parents(parents),
        )

    def _ok_verdict(
        self,
        block: DraftBlock,
        session: Session,
        drafted: int,
        accepted: list[int],
        next_token: int,
        hidden: torch.Tensor | None,
        started: float,
    ) -> Verdict:
        """Commits a verified block's accepted drafts and next token (cut at a stop or the budget)
        and answers it; ``hidden`` [>= committed, hidden_size]: row j produced the j-th of them."""
        committed, reason = self._cut(session, [*accepted, next_token])
        self._commit(session, committed, reason)
        elapsed = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.verify_duration.observe(elapsed)
            self.metrics.record_round(drafted, len(accepted))
        return Verdict(
            block_id=block.block_id,
            status=OK,
            committed_len=session.committed_len,
            num_accepted=min(len(accepted), len(committed)),
            committed_token_ids=tuple(committed),
            finish_reason=reason,
            hidden_states=None if hidden is None else hidden[: len(committed)],
            verify_seconds=elapsed,
        )

    def _verify_chain(
        self, session: Session, block: DraftBlock, drafts: list[int], logits: torch.Tensor
    ) -> tuple[int, int]:
        """(accepted drafts, the recovered or bonus token) by the verifier, from full logits [k+1, vocab]."""
        k = len(drafts)
        q_ids, q_probs = self._proposal(block, k)  # [1, k, m] x2
        uniforms, exponentials = self._randomness(session, k)  # [1, k], [1, vocab]
        num_accepted, next_token = self.verifier.verify_chain(
            logits[None],  # [1, k+1, vocab]
            torch.tensor([drafts], dtype=torch.long, device=self.device).reshape(1, k),  # [1, k]
            q_ids,
            q_probs,
            session.sampling.temperature,
            session.sampling.top_p,
            session.sampling.top_k,
            uniforms,
            exponentials,
        )
        return int(num_accepted[0]), int(next_token[0])

    def _plan_decode(self, step: DecodeStep) -> GenerateResult | _Step:
        """A finished session answers with no tokens; a live one gets one row."""
        session = self.store.get(step.session_id)
        if session.finished:
            return GenerateResult((), session.committed_len, session.finish_reason)

        def finish(scores: RowScores, hidden: torch.Tensor | None, started: float) -> GenerateResult:
            token = self._sample(session, scores)
            if step.cancelled():
                kv_cache.truncate(session.cache, session.committed_len - 1)
                return GenerateResult((), session.committed_len, session.finish_reason)
            committed, reason = self._cut(session, [token])
            self._commit(session, committed, reason)
            return GenerateResult(tuple(committed), session.committed_len, session.finish_reason)

        return _Step(session, session.tokens[-1:], False, finish, last_only=True, screened=self._screened(session))

    def release(self, session_id: str) -> bool:
        """Frees the session; False when it did not exist."""
        return self.store.release(session_id)

    def expire_idle(self) -> list[str]:
        """Drops sessions idle for longer than the TTL; returns their ids."""
        expired = self.store.expire_idle()
        if expired:
            log.info("expired %d idle session(s)", len(expired))
        return expired

    def check_tokenizer(self, fingerprint: str) -> None:
        """Refuses a caller whose (non-empty) tokenizer fingerprint differs from the target's."""
        ours = self.info.tokenizer_fingerprint
        if fingerprint and fingerprint != ours:
            raise TokenizerMismatch(
                f"tokenizer mismatch: the target model {self.info.model_name!r} has tokenizer fingerprint {ours}, "
                f"the caller's tokenizer has {fingerprint}; draft and target must share a tokenizer"
            )

    def warmup(self) -> None:
        """One forward pass and one verification, so the first request pays no lazy set-up."""
        config = SessionConfig(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=8, seed=0)
        session = Session(
            session_id="",
            config=config,
            prompt_len=8,
            tokens=[0] * 8,
            cache=kv_cache.new_cache(),
            generator=make_generator(0, self.device),
            sampling=SamplingTensors.of(config, self.device),
        )
        logits, hidden = self._forward(session, session.tokens, want_hidden=self.greedy_head is not None)  # [8, vocab]
        if self.greedy_head is not None:
            self.greedy_head(hidden)  # [8]: oneDNN builds its bfloat16 kernels now
        uniforms, exponentials = self._randomness(session, 7)  # [1, 7], [1, vocab]
        drafts = torch.zeros(1, 7, dtype=torch.long, device=self.device)  # [1, 7]
        self.verifier.verify_chain(
            logits[None],
            drafts,
            drafts[..., None],
            torch.ones(1, 7, 1, device=self.device),
            session.sampling.temperature,
            session.sampling.top_p,
            session.sampling.top_k,
            uniforms,
            exponentials,
        )

    # ----------------------------------------------------------------------------- internals

    @torch.inference_mode()
    def _forward(
        self,
        session: Session,
        token_ids: Sequence[int],
        last_only: bool = False,
        want_hidden: bool = False,
        no_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the model over ``token_ids`` after the session's cache, appending to the cache.

        Returns the logits ``[n, vocab]`` (``[1, vocab]`` with ``last_only``, ``[0, vocab]`` with
        ``no_logits``) and, with ``want_hidden``, the final hidden states ``[n, hidden_size]`` (after
        the final norm: what the LM head multiplies, the features an EAGLE-style drafter is
        conditioned on).
        """
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        keep: int | torch.Tensor = 1 if last_only else 0
        if no_logits:
            keep = torch.empty(0, dtype=torch.long, device=self.device)  # the LM head over no rows
        try:
            out = self.model(
                input_ids=input_ids,
                cache=session.cache,
                use_cache=True,
                output_hidden_states=want_hidden,
                logits_to_keep=keep,
            )
        except Exception:
            # A pass that failed half-way (out of memory, say) may have grown some layers of the
            # cache and not others; the session cannot go on correctly, so it is dropped.
            self.store.release(session.session_id)
            raise
        logits = out.logits[0]  # [n, vocab] or [1, vocab]
        hidden = out.hidden_states[-1][0] if want_hidden else None  # [n, hidden_size]
        return logits, hidden

    def _forward_steps(self, steps: Sequence[_Step]) -> list[tuple[RowScores, torch.Tensor | None]]:
        """Each step's scores and hidden states ``[n, hidden_size]`` (None unless it asked), from
        one forward pass. A session alone runs as :meth:`_forward` does, except a short step past
        the sliding window, which the ragged path runs faster (the same logits up to float
        summation order)."""
        if not self.batched or (len(steps) == 1 and steps[0].tree is None and not self._ragged_pays(steps[0])):
            outputs = [
                self._forward(
                    step.session,
                    step.token_ids,
                    last_only=step.last_only,
                    want_hidden=step.needs_hidden,
                    no_logits=step.no_logits,
                )
                for step in steps
            ]
            return self._score(steps, outputs)
        try:
            with torch.inference_mode():
                logits, hidden = ragged.forward(
                    self.model,
                    [step.session.cache for step in steps],
                    [step.token_ids for step in steps],
                    self.device,
                    want_hidden=any(step.needs_hidden for step in steps),
                    last_only=[step.last_only for step in steps],
                    no_logits=[step.no_logits for step in steps],
                    trees=[step.tree for step in steps],
                    row_exact=self.row_exact,
                )
        except Exception:
            # As in _forward: caches may have grown in some layers and not others.
            for step in steps:
                self.store.release(step.session.session_id)
            raise
        return self._score(steps, [(rows, hidden[i] if hidden is not None else None) for i, rows in enumerate(logits)])

    def _score(
        self, steps: Sequence[_Step], outputs: Sequence[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> list[tuple[RowScores, torch.Tensor | None]]:
        """Turns (logits, hidden) per step into (scores, the hidden states it asked for): screened
        steps get the argmax of their scored rows, all of the pass's through one screen (one read
        of its weights for every greedy session in the pass)."""
        screened = [
            hidden[-1:] if step.last_only else hidden  # [scored rows, hidden_size]
            for step, (_, hidden) in zip(steps, outputs)
            if step.screened and step.scored
        ]
        tokens = iter(())
        if screened:
            tokens = iter(self.greedy_head(torch.cat(screened)).split([len(rows) for rows in screened]))
        return [
            (
                RowScores()
                if not step.scored
                else RowScores(argmax=next(tokens))
                if step.screened
                else RowScores(logits=logits),
                hidden if step.want_hidden else None,
            )
            for step, (logits, hidden) in zip(steps, outputs)
        ]

    def _ragged_pays(self, step: _Step) -> bool:
        """Whether a session alone runs through ``ragged.forward`` rather than :meth:`_forward`: it is
        faster past the sliding window or without the module tree (``lean``), and it is the row-exact
        path (``row_exact``)."""
        return len(step.token_ids) <= RAGGED_LONE_MAX_ROWS and (
            self.row_exact
            or self.lean
            or (self.ragged_after is not None and kv_cache.cache_length(step.session.cache) > self.ragged_after)
        )

    def _screened(self, session: Session) -> bool:
        """Whether the session's tokens come from the screened head: greedy, and the engine has one."""
        return self.greedy_head is not None and bool(is_greedy(session.sampling.temperature)[0])

    def _sample(self, session: Session, scores: RowScores) -> int:
        """One token from the target distribution at the last scored row."""
        if scores.argmax is not None:
            return int(scores.argmax[-1])
        _, exponentials = self._randomness(session, 0)  # [1, vocab]
        s = session.sampling
        logits = scores.logits[-1:]  # [1, vocab]
        return int(self.verifier.sample_tokens(logits, s.temperature, s.top_p, s.top_k, exponentials)[0])

    def _randomness(self, session: Session, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniforms [1, k] and exponentials [1, vocab] from the session's generator.

        Greedy sessions use no randomness; they get ones (valid inputs that are ignored).
        """
        if bool(is_greedy(session.sampling.temperature)[0]):
            ones = torch.ones(1, k + self.vocab_size, device=self.device)
            return ones[:, :k], ones[:, k:]
        return draw_uniforms((1, k), session.generator), draw_exponentials((1, self.vocab_size), session.generator)

    def _proposal(self, block: DraftBlock, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's q for the first k draft tokens as padded ``q_ids``/``q_probs`` [1, k, m]."""
        if not block.draft_probs:  # a deterministic drafter: q is one-hot on each draft token
            ids = torch.tensor(block.draft_token_ids[:k], dtype=torch.long, device=self.device).reshape(1, k, 1)
            return ids, torch.ones(1, k, 1, device=self.device)
        rows = block.draft_probs[:k]
        m = max((len(q.token_ids) for q in rows), default=1)
        ids = torch.zeros(1, k, m, dtype=torch.long)  # [1, k, m]; padding has probability 0
        probs = torch.zeros(1, k, m, dtype=torch.float64)  # [1, k, m]
        for j, q in enumerate(rows):
            ids[0, j, : len(q.token_ids)] = torch.tensor(q.token_ids, dtype=torch.long)
            probs[0, j, : len(q.probs)] = torch.tensor(q.probs, dtype=torch.float64)
        # Validation allows a small rounding error in the sums; the verifier wants q exactly normalised.
        probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        return ids.to(self.device), probs.float().to(self.device)

    def _cut(self, session: Session, new_tokens: list[int]) -> tuple[list[int], int]:
        """The tokens to commit: up to and including the first stop token, within the budget."""
        for i, token in enumerate(new_tokens):
            if token in session.config.stop_token_ids or (token in self._eos and not session.config.ignore_eos):
                return new_tokens[: i + 1], STOP
            if session.generated + i + 1 >= session.config.max_new_tokens:
                return new_tokens[: i + 1], LENGTH
        return new_tokens, NOT_FINISHED

    def _commit(self, session: Session, new_tokens: list[int], reason: int) -> None:
        """Appends tokens and restores the invariant (cache == tokens[:-1]), or finishes."""
        session.tokens.extend(new_tokens)
        if reason != NOT_FINISHED:
            self.store.finish(session, reason)
        else:
            kv_cache.truncate(session.cache, session.committed_len - 1)

    def _report_live(self, live: int) -> None:
        if self.metrics is not None:
            self.metrics.sessions_active.labels(mode="target").set(live)


def _greedy_chain(drafts: Sequence[int], targets: Sequence[int]) -> tuple[int, int]:
    """Greedy verification from the target's choices (``targets``: k+1 tokens, row i's argmax):
    drafts are accepted while they equal the target's choice; the next token is the target's
    choice after the last accepted one (the recovered token, or the bonus after a full block).
    What ``verify_chain`` does for a greedy row, without its logits."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted, int(targets[accepted])


def _unwrap(answer: Answer | Exception) -> Answer:
    if isinstance(answer, Exception):
        raise answer
    return answer


def _extends(committed: list[int], base_len: int, assumed: Sequence[int]) -> bool:
    """Whether ``committed[:base_len] + assumed`` is exactly the committed sequence."""
    return base_len + len(assumed) == len(committed) and committed[base_len:] == list(assumed)


def _sliding_window(text_config) -> int | None:
    """The window of the model's sliding-attention layers, or None when it has none."""
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None) or ()
    if not window or "sliding_attention" not in layer_types:
        return None
    return int(window)


def _context_len(text_config, configured: int) -> int:
    """Tokens per session: the configured limit, capped by the model's position embeddings."""
    model_limit = int(getattr(text_config, "max_position_embeddings", 0) or 0)
    limits = [limit for limit in (configured, model_limit) if limit > 0]
    if not limits:
        raise ValueError("the model config names no max_position_embeddings; set max_context_len")
    return min(limits)


def _eos_token_ids(loaded: LoadedModel, vocab_size: int) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    found: set[int] = set()
    for source in (getattr(loaded.model, "generation_config", None), loaded.model.config, loaded.tokenizer):
        value = getattr(source, "eos_token_id", None)
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(token, int) and 0 <= token < vocab_size:
                found.add(token)
    return tuple(sorted(found))
