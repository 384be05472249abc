"""The target session behind one request: its id, token budget, prefill, resync and release.

A request starts with one target session (``Prefill`` of the prompt, which also gives the first
token) and ends by releasing it. After a draft failure the target may hold tokens the client never
received (the draft died between the target's commit and forwarding the verdict), or the session
may have been finished or released by the dying draft. Then the request *resyncs*: it prefills a
fresh target session with the prompt plus exactly the tokens the client has received, releases the
old one, and continues from there (the target's greedy output is the same; sampled output keeps the
target's distribution, as the discarded tokens were never shown). At most :data:`MAX_RESYNCS`.

Invariant: the current session's committed sequence is the prompt plus the client's completion;
every batch is checked against it (:meth:`TargetSession.check_in_step`), and a session's
``prompt_len`` and ``budget`` always describe the session as it was prefilled.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence

from gateway import wire
from gateway.deps import GenerationDeps
from gateway.errors import GatewayError, UpstreamFailure, UpstreamUnavailable
from gateway.policy import Mode
from gateway.request import GenerationRequest
from gateway.types import Batch, SessionParams

# The session's log lines keep the name they always had: one logger for a request's story.
log = logging.getLogger("gateway.generation")

# Fresh target sessions one request may need after draft failures before it gives up.
MAX_RESYNCS = 3


class Resync(Exception):
    """The target session is no longer in step with what the client received."""


class TargetSession:
    def __init__(self, request: GenerationRequest, deps: GenerationDeps) -> None:
        self._request = request
        self._deps = deps
        self.session_id = uuid.uuid4().hex
        # The current session's prompt length and token budget (they change on a resync).
        self.prompt_len = len(request.prompt_token_ids)
        self.budget = request.max_tokens
        # From the Prefill call on, the target may hold a session that must be released.
        self.may_hold = False
        # Set after a draft failure until a Generate message proves the target is in step.
        self.suspect = False
        self.resyncs = 0

    def params(self) -> SessionParams:
        request = self._request
        return SessionParams(request.sampling, self.budget, request.ignore_eos, request.stop_token_ids)

    async def open(self) -> Batch:
        """Prefills the prompt: the request's first token. Raises what the target call raised."""
        self.may_hold = True
        try:
            return await self._prefill(self._request.prompt_token_ids, mode=None)
        except UpstreamUnavailable:
            # The prefill never reached the target: there is no session to release.
            self.may_hold = False
            raise

    async def resync(self, completion: Sequence[int], why: str) -> Batch:
        """Continues in a fresh target session prefilled with exactly the tokens the client has."""
        if self.resyncs >= MAX_RESYNCS:
            raise UpstreamFailure(f"session {self.session_id} lost step with the target {self.resyncs} times: {why}",
                                  code="upstream_error")
        self.resyncs += 1
        old, self.session_id = self.session_id, uuid.uuid4().hex
        log.warning("session %s: %s; continuing as session %s from the %d tokens streamed so far",
                    old, why, self.session_id, len(completion))
        self._deps.background.spawn(self._release(old))
        self.prompt_len = len(self._request.prompt_token_ids) + len(completion)
        self.budget = self._request.max_tokens - len(completion)
        self.suspect = False
        return await self._prefill((*self._request.prompt_token_ids, *completion), mode=Mode.AUTOREGRESSIVE)

    def check_in_step(self, committed_len: int, expected: int) -> None:
        """Fails the request when the target committed other than ``expected`` tokens (0: not said)."""
        if committed_len and committed_len != expected:
            raise UpstreamFailure(
                f"session {self.session_id} is out of step with the target: {committed_len} tokens "
                f"committed, but the gateway has received {expected}; refusing to return a text with gaps",
                code="upstream_error",
            )

    def release_later(self) -> asyncio.Task | None:
        """Starts releasing the current session if the target may hold it (a background task,
        which a cancelled caller does not cancel); None when there is nothing to release."""
        return self._deps.background.spawn(self._release(self.session_id)) if self.may_hold else None

    async def _prefill(self, token_ids: Sequence[int], mode: Mode | None) -> Batch:
        request = wire.prefill_request(self.session_id, token_ids, self.params(), self._deps.model.fingerprint)
        counters = self._deps.counters
        counters.prefill_started()
        try:
            response = await self._deps.target.prefill(request)
        finally:
            counters.prefill_finished(time.monotonic())
        return wire.batch_from_prefill(response, mode)

    async def _release(self, session_id: str) -> None:
        try:
            await self._deps.target.release(session_id)
        except GatewayError as exc:
            # The target's session TTL frees it eventually; the request's outcome does not change.
            log.warning("could not release session %s: %s", session_id, exc.message)
