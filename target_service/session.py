"""Sessions: one sequence each, owned by the target between Prefill and Release.

A session holds the truth about its sequence: the committed tokens and a KV cache that holds
exactly ``tokens[:-1]`` (the last committed token is fed with the next block or step, so its
keys are written together with the tokens that follow it). A finished session drops its KV cache
at once but keeps its record (tokens, finish reason) so late blocks get FINISHED rather than
NOT_FOUND, until Release or the TTL.

The store is not thread-safe: the engine is only called from one worker thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from kernels.reference.sampling import GREEDY_TEMPERATURE
from target_service.types import FinishReason, Grammar, SessionParams
from target_service.errors import InvalidArgument, SessionExists, SessionNotFound, TooManySessions
from target_service import kv_cache
from target_service.prefix_cache import MIN_TOKENS, PrefixCache, common_prefix

if TYPE_CHECKING:
    from target_service.allowed_tokens import AllowedTokens
    from target_service.bad_words import BadWords
    from target_service.grammar import Constraint
    from target_service.logit_bias import LogitBias
    from target_service.penalties import Penalties


@dataclass(frozen=True)
class SessionConfig:
    """Everything fixed at a session's start: ``tandem.rpc.types.SessionParams`` as the engine reads
    it (sampling flattened), and whether Verify returns hidden states."""

    max_new_tokens: int  # tokens the session may generate, the first one from Prefill included
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 0.0  # 0 or 1 = no top-p
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None  # None = a fresh random seed
    min_p: float = 0.0  # 0 = none (target_service.min_p)
    typical_p: float = 0.0  # 0 or 1 = none (target_service.typical_p)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    return_hidden_states: bool = False
    top_logprobs: int | None = None  # None: no log-probabilities; n: each token's and the n most probable
    grammar: Grammar | None = None  # constrain the output (target_service.grammar)
    presence_penalty: float = 0.0  # (target_service.penalties)
    frequency_penalty: float = 0.0
    continued_tokens: int = 0  # the prompt's last tokens that are this generation's output so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs (target_service.logit_bias)
    min_tokens: int = 0  # the session's first tokens that are never stop tokens (target_service.min_tokens)
    repetition_penalty: float = 1.0  # (target_service.penalties)
    bad_words: tuple[tuple[int, ...], ...] = ()  # banned token sequences (target_service.bad_words)
    allowed_token_ids: tuple[int, ...] = ()  # (): all (target_service.allowed_tokens)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def cuts_by_min_p(self) -> bool:
        """Whether min_p drops tokens (a greedy session's argmax always stays)."""
        return self.min_p > 0.0 and self.temperature >= GREEDY_TEMPERATURE

    @property
    def cuts_by_typical_p(self) -> bool:
        """Whether typical_p drops tokens (greedy sessions skip it, as Hugging Face's ``generate`` does)."""
        return 0.0 < self.typical_p < 1.0 and self.temperature >= GREEDY_TEMPERATURE

    @property
    def reshapes_logits(self) -> bool:
        """Whether tokens are chosen from logits other than the model's: biased, penalised or masked."""
        return (bool(self.logit_bias) or self.penalized or self.grammar is not None or self.cuts_by_min_p
                or self.cuts_by_typical_p or bool(self.bad_words) or bool(self.allowed_token_ids))

    @classmethod
    def of(cls, params: SessionParams, return_hidden_states: bool = False) -> SessionConfig:
        sampling = params.sampling
        return cls(
            max_new_tokens=params.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            min_p=sampling.min_p,
            typical_p=sampling.typical_p,
            ignore_eos=params.ignore_eos,
            stop_token_ids=params.stop_token_ids,
            return_hidden_states=return_hidden_states,
            top_logprobs=params.top_logprobs,
            grammar=params.grammar,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            continued_tokens=params.continued_tokens,
            logit_bias=params.logit_bias,
            min_tokens=params.min_tokens,
            repetition_penalty=params.repetition_penalty,
            bad_words=params.bad_words,
            allowed_token_ids=params.allowed_token_ids,
        )


@dataclass(frozen=True)
class SamplingTensors:
    """A session's sampling parameters as the batch-of-one tensors the kernels take."""

    temperature: torch.Tensor  # [1] float32
    top_p: torch.Tensor  # [1] float32
    top_k: torch.Tensor  # [1] int64

    @classmethod
    def of(cls, config: SessionConfig, device: str) -> SamplingTensors:
        return cls(
            temperature=torch.tensor([config.temperature], dtype=torch.float32, device=device),
            top_p=torch.tensor([config.top_p], dtype=torch.float32, device=device),
            top_k=torch.tensor([config.top_k], dtype=torch.long, device=device),
        )


@dataclass
class Session:
    session_id: str
    config: SessionConfig
    prompt_len: int
    tokens: list[int]  # committed: prompt + generated
    cache: DynamicCache | None  # holds exactly tokens[:-1]; None once finished
    generator: torch.Generator = field(repr=False)  # seeded from config.seed; all the session's randomness
    sampling: SamplingTensors = field(repr=False)
    last_used: float = 0.0
    finish_reason: FinishReason = FinishReason.NONE
    # The grammar's state after the generated tokens, where config.grammar is set (target_service.grammar).
    constraint: Constraint | None = field(default=None, repr=False)
    # The generated tokens' counts, where the config has penalties (target_service.penalties).
    penalties: Penalties | None = field(default=None, repr=False)
    # The bias added to every row's logits, where the config has one (target_service.logit_bias).
    logit_bias: LogitBias | None = field(default=None, repr=False)
    # The banned sequences, where the config has them (target_service.bad_words).
    bad_words: BadWords | None = field(default=None, repr=False)
    # The only tokens it may generate, where the config names them (target_service.allowed_tokens).
    allowed: AllowedTokens | None = field(default=None, repr=False)

    @property
    def committed_len(self) -> int:
        return len(self.tokens)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def holds_stops(self) -> bool:
        """Whether the next token is among the first ``min_tokens``, which are never stop tokens (a
        session that ignores EOS and has no stop token ids has none to hold back)."""
        has_stops = not self.config.ignore_eos or bool(self.config.stop_token_ids)
        return has_stops and self.generated < self.config.min_tokens

    @property
    def reshapes_logits(self) -> bool:
        """Whether the next tokens are chosen from logits other than the model's (its config's
        reshaping, or stop tokens held back by ``min_tokens``)."""
        return self.config.reshapes_logits or self.holds_stops

    @property
    def remaining(self) -> int:
        """Tokens the session may still generate."""
        return self.config.max_new_tokens - self.generated

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE


def make_generator(seed: int | None, device: str) -> torch.Generator:
    """The session's generator: ``seed`` makes its tokens reproducible, None draws a fresh seed."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def kv_tokens(prompt_len: int, config: SessionConfig) -> int:
    """The most positions a session's KV cache can come to hold: its prompt and every token it may generate."""
    return prompt_len + config.max_new_tokens


class SessionStore:
    """Sessions by id, with a cap on live sessions, a KV cache budget and expiry after ``ttl_s``
    idle seconds.

    The budget (``kv_budget_tokens``, 0 = none) is counted in cache positions: each live session
    reserves :func:`kv_tokens` of them when it is added and gives them back when it finishes or
    goes. Reserving the most a session can use, as TGI does with ``max_total_tokens``, means sessions
    admitted can always run to their end: the alternative, running out of memory half-way, kills
    the process and every session with it.

    ``on_live_change(n)`` is called with the number of live (unfinished) sessions whenever it
    changes; the engine feeds it to the ``tandem_sessions_active`` gauge.

    With a ``prefix_cache``, a session's cache goes there when the session finishes or goes, and
    the kept caches take only the budget's room that live sessions do not reserve: a new session
    that needs it evicts them.
    """

    def __init__(
        self,
        ttl_s: float,
        max_live: int,
        clock: Callable[[], float] = time.monotonic,
        on_live_change: Callable[[int], None] = lambda live: None,
        kv_budget_tokens: int = 0,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_live = max_live
        self.clock = clock
        self.kv_budget_tokens = kv_budget_tokens
        self._on_live_change = on_live_change
        self._sessions: dict[str, Session] = {}
        self._live = 0
        self._reserved = 0  # KV positions reserved by live sessions
        self.prefix_cache = prefix_cache

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def live(self) -> int:
        return self._live

    @property
    def reserved_kv_tokens(self) -> int:
        return self._reserved

    def check_can_add(self, session_id: str, positions: int = 0) -> None:
        """Raises unless a new session of this id, reserving ``positions`` cache positions, may be
        created (call before costly work)."""
        self.expire_idle()
        if session_id in self._sessions:
            raise SessionExists(f"session {session_id!r} already exists")
        if self._live >= self.max_live:
            raise TooManySessions(f"the target holds {self._live} sessions already (max_sessions={self.max_live})")
        budget = self.kv_budget_tokens
        if budget and positions > budget:
            raise InvalidArgument(
                f"the prompt and max_new_tokens need up to {positions} positions of KV cache, more than the target's "
                f"whole budget of {budget}; ask for fewer tokens"
            )
        if budget and self.prefix_cache is not None:
            self.prefix_cache.shrink_to(budget - self._reserved - positions)
        if budget and self._reserved + positions > budget:
            raise TooManySessions(
                f"the target's KV cache budget is taken: {self._reserved} of {budget} positions are reserved by "
                f"{self._live} sessions, this one needs {positions}; retry when sessions have finished"
            )

    def add(self, session: Session) -> None:
        reserve = kv_tokens(session.prompt_len, session.config)
        self.check_can_add(session.session_id, reserve)
        session.last_used = self.clock()
        self._sessions[session.session_id] = session
        self._reserved += reserve
        self._set_live(self._live + 1)

    def shared_prefix(self, prompt: Sequence[int], at_least: int) -> tuple[DynamicCache, int] | None:
        """A copy of the cache of the longest prefix of ``prompt`` that a live session's committed
        tokens begin with, and its length, if longer than ``at_least`` and :data:`MIN_TOKENS`;
        leaves the prompt's last token to prefill. Sessions that share a prompt while both live (a
        request's ``n`` choices, started one after the other) then prefill it once."""
        limit = len(prompt) - 1
        best, source = max(at_least, MIN_TOKENS - 1), None
        for session in self._sessions.values():
            if session.finished or session.cache is None or session.tokens[:1] != list(prompt[:1]):
                continue
            held = min(kv_cache.cache_length(session.cache), len(session.tokens) - 1, limit)
            if held <= best:
                continue
            common = common_prefix(session.tokens, prompt, held)
            if common > best:
                best, source = common, session
        return None if source is None else (kv_cache.copy_prefix(source.cache, best), best)

    def get(self, session_id: str) -> Session:
        """The session (and marks it used), or SessionNotFound."""
        session = self._sessions.get(session_id)
        if session is not None and self._expired(session):
            self._drop(session)
            session = None
        if session is None:
            raise SessionNotFound(f"unknown session {session_id!r} (never created, released, or expired)")
        session.last_used = self.clock()
        return session

    def finish(self, session: Session, reason: FinishReason) -> None:
        """Marks a session finished and frees its KV cache."""
        if session.finished:
            return
        session.finish_reason = reason
        self._reserved -= kv_tokens(session.prompt_len, session.config)
        self._let_go(session)
        self._set_live(self._live - 1)

    def release(self, session_id: str) -> bool:
        """Drops a session; False when there was none (release is idempotent)."""
        session = self._sessions.get(session_id)
        if session is None:
            return False
        expired = self._expired(session)
        self._drop(session)
        return not expired

    def expire_idle(self) -> list[str]:
        """Drops every session idle for longer than the TTL; returns their ids."""
        expired = [s for s in self._sessions.values() if self._expired(s)]
        for session in expired:
            self._drop(session)
        return [s.session_id for s in expired]

    def _expired(self, session: Session) -> bool:
        return self.clock() - session.last_used > self.ttl_s

    def _drop(self, session: Session) -> None:
        del self._sessions[session.session_id]
        if not session.finished:
            self._reserved -= kv_tokens(session.prompt_len, session.config)
            self._set_live(self._live - 1)
        self._let_go(session)

    def _let_go(self, session: Session) -> None:
        """Frees the session's cache, into the prefix cache when there is one."""
        if self.prefix_cache is not None and session.cache is not None:
            room = self.kv_budget_tokens - self._reserved if self.kv_budget_tokens else None
            self.prefix_cache.keep(session.tokens, session.cache, room)
        session.cache = None

    def _set_live(self, live: int) -> None:
        self._live = live
        self._on_live_change(live)
