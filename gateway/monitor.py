"""Watches the target and draft pools: membership, health, load, model info, tokenizer agreement.

The gateway is ready (HTTP ``/health`` 200, gRPC health SERVING) only while some target and some
draft report SERVING on their ``grpc.health.v1`` endpoint *and* tokenize exactly as the gateway
does. Token ids mean nothing across different tokenizers, so a fingerprint mismatch marks the
member unusable with an error naming both models, never a silent degradation. The monitor also
adopts the targets' context length (``Info.max_context_len``), which may be below the
checkpoint's, and reads each member's load from its ``Info`` for placement (:mod:`gateway.pool`).

Each check re-resolves the pools' DNS names (at most every ``resolve_interval_s``), takes back a
member that a session took out once it is SERVING again, and sends the releases the gateway owes a
target that was down. The policy reads :attr:`UpstreamMonitor.draft_ready` so that
``speculation: "auto"`` does not even try a draft pool that is known to be down. Each draft check
is also the health probe of that draft's circuit breaker (:mod:`gateway.breaker`), which
generations feed with their own failures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.errors import GatewayError
from gateway.pool import Member, Pool
from gateway.served_model import ServedModel
from gateway.upstream import GrpcDraft, GrpcTarget

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 2.0
# How often a gateway that is not ready checks its upstreams (a health check is a cheap RPC).
WAITING_INTERVAL_S = 0.25


class UpstreamMonitor:
    def __init__(
        self,
        targets: Pool[GrpcTarget],
        drafts: Pool[GrpcDraft],
        model: ServedModel,
        resolve_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.targets = targets
        self.drafts = drafts
        self._model = model
        self._resolve_interval_s = resolve_interval_s
        self._clock = clock
        self._resolved_at: float | None = None
        # A draft's self-description (proposer, model, K), for GatewayService.Info.
        self.draft_info: Any = None
        # Awaited with the new readiness whenever a check finds it changed (and after the first).
        self.on_readiness_change: Callable[[bool], Awaitable[None]] | None = None
        self._last_ready: bool | None = None
        self._lock = asyncio.Lock()

    @property
    def ready(self) -> bool:
        return self.targets.serving and self.drafts.serving

    @property
    def draft_ready(self) -> bool:
        """Whether new sessions may speculate: some draft's breaker is not open (it opens once a
        check finds that draft unreachable, or sessions see it fail; unknown counts as ready).

        A draft with the wrong tokenizer is reachable: requests go to it and fail with its
        refusal, rather than quietly decoding without speculation."""
        return any(m.breaker is None or m.breaker.allows_speculation for m in self.drafts.members.values())

    async def check(self) -> bool:
        """Refreshes both pools; returns :attr:`ready`. Every check (the periodic one, or one
        made for HTTP ``/health``) reports a change of readiness at once."""
        async with self._lock:
            now = self._clock()
            if self._resolved_at is None or now - self._resolved_at >= self._resolve_interval_s:
                self._resolved_at = now
                await asyncio.gather(self.targets.resolve(), self.drafts.resolve())
            await asyncio.gather(*(self._check_target(m) for m in list(self.targets.members.values())),
                                 *(self._check_draft(m) for m in list(self.drafts.members.values())))
            ready = self.ready
            if ready != self._last_ready:
                # Not ready before the first ready (upstreams still loading) is expected: info.
                level = logging.INFO if ready or self._last_ready is None else logging.WARNING
                log.log(level, "upstreams %s: targets %s; drafts %s", "ready" if ready else "not ready",
                        self.targets.describe(), self.drafts.describe())
                self._last_ready = ready
                if self.on_readiness_change is not None:
                    await self.on_readiness_change(ready)
            return ready

    async def watch(self, interval: float, waiting_interval: float = WAITING_INTERVAL_S) -> None:
        """Checks every ``interval`` seconds, forever; every ``waiting_interval`` while not ready, so
        the gateway serves as soon as its upstreams do (at start-up, and after they were all down)
        rather than up to ``interval`` later."""
        while True:
            await asyncio.sleep(interval if self._last_ready else min(interval, waiting_interval))
            await self.check()

    async def _check_target(self, member: Member[GrpcTarget]) -> None:
        info = await self._serving_info(member)
        if info is None:
            return
        if not self._same_tokenizer(member, "target", info.model_name, info.tokenizer_fingerprint):
            return
        if info.max_context_len > 0:
            self._model.max_context_len = info.max_context_len
        member.report(info.active_sessions, info.queued_passes)
        self._set(member, True, f"serving {info.model_name}")
        await self._settle_releases(member)

    async def _check_draft(self, member: Member[GrpcDraft]) -> None:
        info = await self._serving_info(member)
        if member.breaker is not None:
            member.breaker.probe(bool(member.reachable))
        if info is None:
            return
        name = info.model_name or info.proposer
        # Model-free proposers (ngram) have no tokenizer and send an empty fingerprint.
        if info.tokenizer_fingerprint and not self._same_tokenizer(member, "draft", name, info.tokenizer_fingerprint):
            return
        self.draft_info = info
        member.report(info.active_sessions)
        self._set(member, True, f"serving {name} (proposer {info.proposer})")

    async def _serving_info(self, member: Member[Any]) -> Any:
        upstream = member.client
        member.reachable = await upstream.is_serving(CHECK_TIMEOUT_S)
        if not member.reachable:
            self._set(member, False, "not serving")
            return None
        try:
            return await upstream.info(CHECK_TIMEOUT_S)
        except GatewayError as exc:
            self._set(member, False, exc.message)
            return None

    @staticmethod
    async def _settle_releases(member: Member[GrpcTarget]) -> None:
        """Releases the sessions a target held when it was taken out (a hung target that woke up
        still has them): nothing leaks in a target that comes back."""
        for session_id in list(member.owed_releases):
            try:
                await member.client.release(session_id)
            except GatewayError:
                return  # down again: the next check tries again
            member.owed_releases.discard(session_id)

    def _same_tokenizer(self, member: Member[Any], role: str, name: str, fingerprint: str) -> bool:
        if fingerprint == self._model.fingerprint:
            return True
        detail = (
            f"tokenizer mismatch: the gateway tokenizes for {self._model.name} (fingerprint "
            f"{self._model.fingerprint}) but the {role} serves {name} (fingerprint {fingerprint})"
        )
        if member.detail != detail:
            log.error("%s", detail)
        self._set(member, False, detail)
        return False

    @staticmethod
    def _set(member: Member[Any], serving: bool, detail: str) -> None:
        if serving and member.serving is False and member.was_serving:
            log.info("%s is serving again: back in the pool", member.address)
        member.was_serving = member.was_serving or serving
        member.serving = serving
        member.detail = detail
