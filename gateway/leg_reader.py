"""Reads one leg of a request (a ``Speculate`` or a ``Generate`` stream) into committed batches.

Each message is turned into a :class:`gateway.types.Batch` (by :mod:`gateway.wire`) and reported
to the session controller, the step timer, the breaker and the shared counters on the way. A
speculative leg watches for a stalled draft: a silence of ``draft_stall_timeout_s`` is a stall
unless the target is busy (:meth:`gateway.deps.GenerationDeps.draft_silence_explained`), and never
longer than ``draft_stall_cap_factor`` times that. An autoregressive leg right after a draft
failure checks that the target is in step with the client and asks for a resync if not.

Each speculative leg is placed on a draft of the pool (:mod:`gateway.pool`): among those that
have committed the most tokens per second for the session's target (:mod:`gateway.draft_speeds`,
to which each leg that did not fail reports), the least loaded; its ``Speculate`` call names
the session's target. A leg placed to explore a draft measured slower than another is a probe:
its call commits at most ``--draft-probe-tokens`` there, and the rest of the leg is placed again.
A draft that refuses the target (not one of its own) is left out for it and the leg goes to
another, before anything was drafted or committed. Either kind of leg that hears nothing for
``target_timeout_s`` asks the session's target for its health; a target that does not answer is
lost (:class:`gateway.errors.TargetLost`, which the generation answers with a failover), as is
one whose connection drops, directly or under the draft.

Invariant: the reader holds at most one upstream stream, the current one, which :meth:`cancel`
cancels (a cancelled ``Speculate`` makes the draft release its state), and at most one draft
placement, closed when its leg ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial
from typing import Any

from gateway import wire
from gateway.adaptive import Leg, Round, SessionController
from gateway.breaker import DraftFailure
from gateway.deps import GenerationDeps
from gateway.errors import GatewayError, TargetLost, TargetNotServed, UpstreamUnavailable
from gateway.legs import DraftLegFailed, classify_draft_error, timed
from gateway.output import Output
from gateway.policy import Mode
from gateway.pool import Member, Placement
from gateway.request import GenerationRequest, Speculation
from gateway.target_session import Resync, TargetSession
from gateway.types import Batch, FinishReason
from gateway.upstream import UpstreamStream

log = logging.getLogger(__name__)


class LegReader:
    def __init__(self, request: GenerationRequest, deps: GenerationDeps, session: TargetSession,
                 output: Output) -> None:
        self._request = request
        self._deps = deps
        self._session = session
        self._output = output
        self._stream: UpstreamStream[Any] | None = None
        # Drafts not to place the next speculative legs on while others serve (one that failed).
        self.avoid_draft: frozenset[str] = frozenset()

    def cancel(self) -> None:
        """Cancels the current upstream stream, if any (it wakes up a reader waiting on it)."""
        if self._stream is not None:
            self._stream.cancel()

    def read(self, leg: Leg, controller: SessionController) -> AsyncIterator[Batch]:
        """The batches of ``leg``; raises :class:`DraftLegFailed` or :class:`Resync` when they stop."""
        if leg.mode is Mode.SPECULATIVE:
            return self._speculative(leg, controller)
        return self._autoregressive(leg, controller)

    async def _speculative(self, leg: Leg, controller: SessionController) -> AsyncIterator[Batch]:
        deps = self._deps
        target = self._session.address
        left = leg.max_new_tokens  # what the leg may still commit (0: no limit, the session's end)
        while True:
            # A session that insists on speculation tries a draft even when none is known to serve.
            placement = deps.drafts.place(self.avoid_draft, anyhow=self._request.speculation is Speculation.ON,
                                          prefer=partial(deps.draft_speeds.choose, target=target))
            if placement is None:
                error = UpstreamUnavailable(deps.drafts.unavailable(), code="upstream_unavailable")
                raise DraftLegFailed(DraftFailure.UNREACHABLE, error)
            if deps.draft_speeds.refuses(placement.address, target):  # every draft left refuses it
                placement.close()
                error = TargetNotServed(f"no draft of the pool serves the target {target} (each refused it: it is not "
                                        "in their --target-address)", draft=placement.address, target=target)
                # As if no draft were up: "auto" decodes with Generate, "on" gets the error.
                raise DraftLegFailed(DraftFailure.UNREACHABLE, error)
            probe = deps.draft_speeds.probe_budget(placement.address, target)
            budget = min(left, probe) if left and probe else (left or probe)
            yielded, committed, finished = False, 0, False
            try:
                async with aclosing(self._measured(budget, controller, placement, target)) as batches:
                    async for batch in batches:
                        yielded = True
                        committed += len(batch.token_ids)
                        finished = batch.finish_reason is not FinishReason.NONE
                        yield batch
                if finished or budget == left or (left and committed >= left):
                    return
                left = left - committed if left else 0  # a probe ended: the rest goes where placement says
                continue
            except TargetNotServed as refusal:  # before any state or commit: the leg goes elsewhere
                if yielded:  # (a draft refuses before it drafts: never after a round)
                    raise classify_draft_error(refusal, placement.member) from refusal
                log.warning("%s; its legs for that target go to other drafts", refusal.message)
                deps.draft_speeds.refused(placement.address, target)

    async def _measured(self, max_new_tokens: int, controller: SessionController, placement: Placement[Any],
                        target: str) -> AsyncIterator[Batch]:
        """The batches of a ``Speculate`` call on ``placement``'s draft (``max_new_tokens``, 0: no
        limit), reported to :mod:`gateway.draft_speeds`."""
        speeds = self._deps.draft_speeds
        speeds.placed(placement.address, target)
        # From the call's first round on: its set-up and the draft's catch-up are left out, which a
        # short probe would otherwise pay over far fewer rounds than a whole leg.
        first = last = None
        committed = rounds = 0
        measured = False
        try:
            async with aclosing(self._speculate(max_new_tokens, controller, placement.member)) as batches:
                async for batch in batches:
                    if batch.token_ids:
                        last = time.monotonic()
                        if first is None:
                            first = last
                        else:
                            committed, rounds = committed + len(batch.token_ids), rounds + 1
                    yield batch
            measured = True
        except GeneratorExit:  # closed at a yield: the session finished (or its client left)
            measured = True
            raise
        finally:
            placement.close()
            if measured and rounds:  # a leg that failed does not measure its draft (the breaker hears of it)
                speeds.observe(placement.address, target, committed, rounds, last - first)

    async def _speculate(self, max_new_tokens: int, controller: SessionController,
                         draft: Member[Any]) -> AsyncIterator[Batch]:
        stream = self._stream = draft.client.speculate(self._speculate_request(max_new_tokens))
        deps = self._deps
        stall = deps.tuning.draft_stall_timeout_s
        cap = stall * deps.tuning.draft_stall_cap_factor
        answered = False  # before a call's first round the draft takes the session on (its own prefill)

        async def keep_waiting(waited_s: float) -> bool:
            await self._session.check_alive()  # a hung target under the draft: TargetLost
            if waited_s < stall:
                return True
            # That prefill grows with the prompt and the machine's load: explained up to the cap.
            return waited_s < cap and (not answered or deps.draft_silence_explained(time.monotonic()))

        try:
            async for message, seconds in timed(stream, time.monotonic, min(stall, deps.tuning.target_timeout_s),
                                                keep_waiting):
                answered = True
                deps.counters.draft_answered(time.monotonic())
                if draft.breaker is not None:
                    draft.breaker.record_success()
                batch = wire.batch_from_speculate(message)
                if batch.token_ids:
                    controller.observe_round(
                        Round(len(batch.token_ids), batch.num_draft_tokens, batch.num_accepted, seconds,
                              positions=batch.num_draft_positions or None)
                    )
                    deps.step_timer.observe_verify(batch.verify_seconds, deps.sessions_per_target(),
                                                   batch.step_seconds)
                yield batch
        except TimeoutError:
            stream.cancel()
            error = UpstreamUnavailable(f"the draft service at {draft.address} sent nothing for {stall:g}s",
                                        code="upstream_unavailable")
            raise DraftLegFailed(DraftFailure.STALLED, error, member=draft) from None
        except (TargetLost, TargetNotServed):
            stream.cancel()
            raise
        except GatewayError as error:
            raise classify_draft_error(error, draft) from error

    async def _autoregressive(self, leg: Leg, controller: SessionController) -> AsyncIterator[Batch]:
        session = self._session
        stream = self._stream = session.target.generate(wire.generate_request(session.session_id,
                                                                              leg.max_new_tokens))

        async def keep_waiting(waited_s: float) -> bool:
            await session.check_alive()
            return True

        try:
            async for message, seconds in timed(stream, time.monotonic, self._deps.tuning.target_timeout_s,
                                                keep_waiting):
                batch = wire.batch_from_generate(message)
                if session.suspect:
                    if batch.committed_len != self._output.expected_len(len(batch.token_ids)):
                        stream.cancel()
                        raise Resync("the target committed tokens the failed draft never forwarded")
                    session.suspect = False
                if batch.token_ids:
                    controller.observe_autoregressive(len(batch.token_ids))
                    if seconds is not None:
                        self._deps.step_timer.observe_step(seconds / len(batch.token_ids),
                                                           self._deps.sessions_per_target(),
                                                           batch.pass_seconds, batch.step_seconds)
                yield batch
        except TargetLost:
            stream.cancel()
            raise
        except GatewayError as error:
            if not session.suspect:
                raise
            # E.g. the failed draft's last verdict finished the session, or it released it.
            raise Resync(f"the target session failed after the draft did: {error.message}") from error

    def _speculate_request(self, max_new_tokens: int) -> Any:
        session = self._session
        return wire.speculate_request(
            session_id=session.session_id,
            # One target: the draft's own (a single-target stack may spell the address differently
            # on each side, e.g. localhost and 127.0.0.1).
            target_address=session.address if len(self._deps.targets.members) > 1 else "",
            token_ids=[*self._request.prompt_token_ids, *self._output.completion],
            prompt_len=session.prompt_len,
            params=session.params(),
            num_speculative_tokens=self._request.num_speculative_tokens or self._deps.default_num_speculative_tokens,
            tokenizer_fingerprint=self._deps.model.fingerprint,
            max_new_tokens=max_new_tokens,
            prediction_token_ids=self._request.prediction_token_ids,
        )
