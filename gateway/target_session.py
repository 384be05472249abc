"""The target session behind one request: its target, id, token budget, prefill, moves and release.

A request starts with one target session (``Prefill`` of the prompt on the least-loaded target of
the pool, or on one not much busier that holds the prompt's beginning in its prefix cache,
:mod:`gateway.prefix_affinity`; the Prefill also gives the first token) and ends by releasing it.
Two things move it to a fresh session, prefilled with the prompt plus exactly the tokens the client
has received:

* a *resync* on the same target: after a draft failure the target may hold tokens the client never
  received (the draft died between the target's commit and forwarding the verdict), or the dying
  draft may have finished or released the session. At most :data:`MAX_RESYNCS`.
* a *failover* to another target: the session's target died, hung past ``--target-timeout-s`` or
  lost the session (:class:`gateway.errors.TargetLost`). The target is taken out of the pool, the
  session is prefilled on another one (or on the same one once it serves again, when it restarts
  in place), waiting up to ``--failover-wait-s`` for one, and the release of the lost session is
  owed to the old target for when it is back. At most :data:`MAX_FAILOVERS`, so a request that
  kills every target it touches does not walk the whole pool.

Either way the target's greedy output is the same, and sampled output keeps the target's
distribution, as the discarded tokens were never shown.

Invariant: the current session's committed sequence is the prompt plus the client's completion;
every batch is checked against it (:meth:`TargetSession.check_in_step`), and a session's
``prompt_len`` and ``budget`` always describe the session as it was prefilled.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from gateway import wire
from gateway.deps import GenerationDeps
from gateway.errors import GatewayError, InvalidRequest, TargetLost, UpstreamFailure, UpstreamUnavailable
from gateway.policy import Mode
from gateway.pool import Placement
from gateway.request import GenerationRequest
from gateway.types import Batch, SessionParams
from gateway.upstream import TargetUpstream
from tandem import telemetry

# The session's log lines keep the name they always had: one logger for a request's story.
log = logging.getLogger("gateway.generation")

# Fresh target sessions one request may need after draft failures before it gives up.
MAX_RESYNCS = 3
# Targets one request may lose before it gives up.
MAX_FAILOVERS = 3

T = TypeVar("T")


class Resync(Exception):
    """The target session is no longer in step with what the client received."""


class TargetSession:
    def __init__(self, request: GenerationRequest, deps: GenerationDeps) -> None:
        self._request = request
        self._deps = deps
        self.session_id = uuid.uuid4().hex
        self.placement: Placement[TargetUpstream] | None = None
        # The current session's prompt length and token budget (they change on a move).
        self.prompt_len = len(request.prompt_token_ids)
        self.budget = request.max_tokens
        # From the Prefill call on, the target may hold a session that must be released.
        self.may_hold = False
        # Set after a draft failure until a Generate message proves the target is in step.
        self.suspect = False
        self.resyncs = 0
        self.failovers = 0

    @property
    def target(self) -> TargetUpstream:
        assert self.placement is not None, "open() places the session"
        return self.placement.client

    @property
    def address(self) -> str:
        return self.placement.address if self.placement is not None else ""

    def params(self) -> SessionParams:
        request = self._request
        return SessionParams(
            request.sampling,
            self.budget,
            request.ignore_eos,
            request.stop_token_ids,
            request.top_logprobs,
            request.grammar,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=request.logit_bias,
            bad_words=request.bad_words,
            allowed_token_ids=request.allowed_token_ids,
            # A session moved or resynced goes on from the text the client has: its grammar,
            # penalties and bad words count that text.
            continued_tokens=self.prompt_len - len(request.prompt_token_ids),
            # Like the budget, the floor counts this session's own tokens.
            min_tokens=max(0, request.min_tokens - (self.prompt_len - len(request.prompt_token_ids))),
        )

    async def open(self) -> Batch:
        """Prefills the prompt on a target of the pool: the request's first token. A target that
        turns out dead is taken out and the next one tried. Raises what the last call raised."""
        prefer = self._deps.prefix_affinity.narrower(self._request.prompt_token_ids)
        self.placement = self._place(frozenset(), prefer)
        self.may_hold = True
        try:
            return await self._prefill(self._request.prompt_token_ids, None, self._request.prompt_logprobs)
        except TargetLost as lost:
            return await self.failover((), lost)
        except InvalidRequest as refused:  # a grammar the target cannot compile: name the field that asked
            if refused.param == "response_format" and self._request.grammar_param != refused.param:
                raise InvalidRequest(refused.message, param=self._request.grammar_param) from None
            raise
        except UpstreamUnavailable:
            # The prefill never reached the target: there is no session to release.
            self.may_hold = False
            raise

    async def resync(self, completion: Sequence[int], why: str, mode: Mode | None = Mode.AUTOREGRESSIVE) -> Batch:
        """Continues in a fresh session on the same target, prefilled with exactly the tokens the
        client has. ``mode``: what the prefill's token counts as in the usage (None: nothing,
        when the session keeps its mode)."""
        if self.resyncs >= MAX_RESYNCS:
            raise UpstreamFailure(f"session {self.session_id} lost step with the target {self.resyncs} times: {why}",
                                  code="upstream_error")
        self.resyncs += 1
        old = self._renew(completion)
        log.warning("session %s: %s; continuing as session %s from the %d tokens streamed so far",
                    old, why, self.session_id, len(completion))
        self._deps.background.spawn(self._release(self.target, old))
        try:
            return await self._prefill((*self._request.prompt_token_ids, *completion), mode=mode)
        except TargetLost as lost:
            return await self.failover(completion, lost)

    async def failover(self, completion: Sequence[int], lost: TargetLost) -> Batch:
        """Moves the session to another target after ``lost``: prefilled with the prompt and
        ``completion`` (what the client has), the stream goes on from there."""
        deps = self._deps
        while True:
            assert self.placement is not None
            old_placement, old_address = self.placement, self.placement.address
            if self.failovers >= MAX_FAILOVERS:
                raise UpstreamUnavailable(f"session {self.session_id} lost {self.failovers + 1} targets; the last: "
                                          f"{lost.message}", code="upstream_unavailable")
            self.failovers += 1
            deps.metrics.session_failovers.labels(reason=lost.reason).inc()
            if lost.reason != "session_lost":
                deps.targets.take_out(old_placement.member, lost.message)
            if self.may_hold:  # released when the old target serves again (the monitor sends it)
                old_placement.member.owed_releases.add(self.session_id)
            old_placement.close()
            old = self._renew(completion)
            self.placement = await self._wait_for_target(frozenset({old_address}), lost)
            log.warning("session %s: %s; continuing as session %s on the target at %s from the %d tokens streamed "
                        "so far", old, lost.message, self.session_id, self.address, len(completion))
            telemetry.record_failover(lost.reason, old_address, self.address, len(completion))
            self.may_hold = True
            try:  # the session keeps its mode: the prefill's token counts as none
                # A move before any token (the first Prefill's target lost) still owes the prompt's scores.
                return await self._prefill((*self._request.prompt_token_ids, *completion), mode=None,
                                           prompt_logprobs=self._request.prompt_logprobs and not completion)
            except TargetLost as again:
                lost = again

    def check_in_step(self, committed_len: int, expected: int) -> None:
        """Fails the request when the target committed other than ``expected`` tokens (0: not said)."""
        if committed_len and committed_len != expected:
            raise UpstreamFailure(
                f"session {self.session_id} is out of step with the target: {committed_len} tokens "
                f"committed, but the gateway has received {expected}; refusing to return a text with gaps",
                code="upstream_error",
            )

    def release_later(self, completion: Sequence[int] = ()) -> asyncio.Task | None:
        """Starts releasing the current session if the target may hold it (a background task,
        which a cancelled caller does not cancel); None when there is nothing to release. Ends
        the session's placement either way. ``completion``: the tokens the client received, whose
        cache (the prompt's and theirs) the target keeps for a prompt that goes on from them."""
        placement, self.placement = self.placement, None
        if placement is None:
            return None
        placement.close()
        if self.may_hold:
            self._deps.prefix_affinity.remember(placement.address, (*self._request.prompt_token_ids, *completion)[:-1])
        return self._deps.background.spawn(self._release(placement.client, self.session_id)) if self.may_hold else None

    async def watched(self, call: Awaitable[T]) -> T:
        """``call`` to the session's target, given up as :class:`TargetLost` when it stays silent
        for ``target_timeout_s`` and the target then fails a health check as long."""
        timeout = self._deps.tuning.target_timeout_s
        pending = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=timeout)
                if done:
                    return pending.result()
                await self.check_alive()
        finally:
            if not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)

    async def check_alive(self, after: str = "") -> None:
        """Raises :class:`TargetLost` unless the session's target answers its health check.
        ``after``: what made the caller ask (default: the target's own silence)."""
        timeout = self._deps.tuning.target_timeout_s
        if await self.target.is_serving(timeout):
            return
        if after:
            raise TargetLost(f"the target service at {self.address} does not answer its health check ({after})",
                             reason="unavailable", address=self.address)
        raise TargetLost(f"the target service at {self.address} stopped answering (nothing for {timeout:g}s, "
                         f"and no health check answer in {timeout:g}s)", reason="timeout", address=self.address)

    def _place(self, avoid: frozenset[str], prefer: Callable[[list], list] | None = None) -> Placement[TargetUpstream]:
        placement = self._deps.targets.place(avoid, prefer=prefer)
        if placement is None:
            raise UpstreamUnavailable(self._deps.targets.unavailable(), code="upstream_unavailable")
        return placement

    async def _wait_for_target(self, avoid: frozenset[str], lost: TargetLost) -> Placement[TargetUpstream]:
        """A placement, as soon as the pool has a usable target (polling the pool, which the
        monitor's health checks refill), for up to ``failover_wait_s``."""
        deadline = time.monotonic() + self._deps.tuning.failover_wait_s
        while True:
            placement = self._deps.targets.place(avoid)
            if placement is not None:
                return placement
            if time.monotonic() >= deadline:
                raise UpstreamUnavailable(
                    f"{lost.message}; no target served within {self._deps.tuning.failover_wait_s:g}s: "
                    f"{self._deps.targets.unavailable()}", code="upstream_unavailable")
            await asyncio.sleep(0.1)

    def _renew(self, completion: Sequence[int]) -> str:
        """A fresh session id for the prompt plus ``completion``; returns the old id."""
        old, self.session_id = self.session_id, uuid.uuid4().hex
        self.prompt_len = len(self._request.prompt_token_ids) + len(completion)
        self.budget = self._request.max_tokens - len(completion)
        self.suspect = False
        return old

    async def _prefill(self, token_ids: Sequence[int], mode: Mode | None, prompt_logprobs: bool = False) -> Batch:
        request = wire.prefill_request(
            self.session_id, token_ids, self.params(), self._deps.model.fingerprint, prompt_logprobs
        )
        counters = self._deps.counters
        counters.prefill_started()
        try:
            response = await self.watched(self.target.prefill(request))
        finally:
            counters.prefill_finished(time.monotonic())
        self._deps.prefix_affinity.remember(self.address, token_ids)
        return wire.batch_from_prefill(response, mode)

    async def _release(self, target: TargetUpstream, session_id: str) -> None:
        try:
            await target.release(session_id)
        except GatewayError as exc:
            # The target's session TTL frees it eventually; the request's outcome does not change.
            log.warning("could not release session %s: %s", session_id, exc.message)
