"""Watches the target and draft services: health, model info, tokenizer agreement.

The gateway is ready (HTTP ``/health`` 200, gRPC health SERVING) only while both upstreams report
SERVING on their ``grpc.health.v1`` endpoint *and* tokenize exactly as the gateway does. Token ids
mean nothing across different tokenizers, so a fingerprint mismatch marks the upstream unusable
with an error naming both models, never a silent degradation. The monitor also adopts the target's
context length (``Info.max_context_len``), which may be below the checkpoint's.

The policy reads :attr:`UpstreamMonitor.draft_ready` so that ``speculation: "auto"`` does not
even try a draft that is known to be down. Each draft check is also the health probe of the
draft's circuit breaker (:mod:`gateway.breaker`), which generations feed with their own
failures; ``draft_ready`` is the breaker's verdict.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.breaker import DraftBreaker
from gateway.errors import GatewayError
from gateway.served_model import ServedModel
from gateway.upstream import GrpcDraft, GrpcTarget

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 2.0


@dataclass
class UpstreamState:
    address: str
    # Usable by the gateway: reachable, SERVING, and tokenizing as the gateway does.
    serving: bool | None = None  # None until the first check
    # Answered its health check with SERVING (whatever its tokenizer).
    reachable: bool | None = None
    detail: str = "not checked yet"

    def to_json(self) -> dict[str, Any]:
        return {"address": self.address, "serving": bool(self.serving), "detail": self.detail}


class UpstreamMonitor:
    def __init__(
        self, target: GrpcTarget, draft: GrpcDraft, model: ServedModel, breaker: DraftBreaker | None = None
    ) -> None:
        self._target = target
        self.breaker = breaker if breaker is not None else DraftBreaker()
        self._draft = draft
        self._model = model
        self.target = UpstreamState(target.address)
        self.draft = UpstreamState(draft.address)
        # The draft's self-description (proposer, model, K), for GatewayService.Info.
        self.draft_info: Any = None
        # Awaited with the new readiness whenever a check finds it changed (and after the first).
        self.on_readiness_change: Callable[[bool], Awaitable[None]] | None = None
        self._last_ready: bool | None = None
        self._lock = asyncio.Lock()

    @property
    def ready(self) -> bool:
        return bool(self.target.serving and self.draft.serving)

    @property
    def draft_ready(self) -> bool:
        """Whether new sessions may speculate: the breaker is not open (it opens once a check finds
        the draft unreachable, or sessions see it fail; unknown counts as ready).

        A draft with the wrong tokenizer is reachable: requests go to it and fail with its
        refusal, rather than quietly decoding without speculation."""
        return self.breaker.allows_speculation

    async def check(self) -> bool:
        """Refreshes both upstreams' state; returns :attr:`ready`. Every check (the periodic
        one, or one made for HTTP ``/health``) reports a change of readiness at once."""
        async with self._lock:
            await asyncio.gather(self._check_target(), self._check_draft())
            ready = self.ready
            if ready != self._last_ready:
                # Not ready before the first ready (upstreams still loading) is expected: info.
                level = logging.INFO if ready or self._last_ready is None else logging.WARNING
                log.log(level, "upstreams %s: target %s; draft %s",
                        "ready" if ready else "not ready", self.target.detail, self.draft.detail)
                self._last_ready = ready
                if self.on_readiness_change is not None:
                    await self.on_readiness_change(ready)
            return ready

    async def watch(self, interval: float) -> None:
        """Checks every ``interval`` seconds, forever."""
        while True:
            await asyncio.sleep(interval)
            await self.check()

    async def _check_target(self) -> None:
        info = await self._serving_info(self._target, self.target)
        if info is None:
            return
        if not self._same_tokenizer(self.target, "target", info.model_name, info.tokenizer_fingerprint):
            return
        if info.max_context_len > 0:
            self._model.max_context_len = info.max_context_len
        self._set(self.target, True, f"serving {info.model_name}")

    async def _check_draft(self) -> None:
        info = await self._serving_info(self._draft, self.draft)
        self.breaker.probe(bool(self.draft.reachable))
        if info is None:
            return
        name = info.model_name or info.proposer
        # Model-free proposers (ngram) have no tokenizer and send an empty fingerprint.
        if info.tokenizer_fingerprint and not self._same_tokenizer(
            self.draft, "draft", name, info.tokenizer_fingerprint
        ):
            return
        self.draft_info = info
        self._set(self.draft, True, f"serving {name} (proposer {info.proposer})")

    async def _serving_info(self, upstream: GrpcTarget | GrpcDraft, state: UpstreamState) -> Any:
        state.reachable = await upstream.is_serving(CHECK_TIMEOUT_S)
        if not state.reachable:
            self._set(state, False, f"not serving at {upstream.address}")
            return None
        try:
            return await upstream.info(CHECK_TIMEOUT_S)
        except GatewayError as exc:
            self._set(state, False, exc.message)
            return None

    def _same_tokenizer(self, state: UpstreamState, role: str, name: str, fingerprint: str) -> bool:
        if fingerprint == self._model.fingerprint:
            return True
        detail = (
            f"tokenizer mismatch: the gateway tokenizes for {self._model.name} (fingerprint "
            f"{self._model.fingerprint}) but the {role} serves {name} (fingerprint {fingerprint})"
        )
        if state.detail != detail:
            log.error("%s", detail)
        self._set(state, False, detail)
        return False

    @staticmethod
    def _set(state: UpstreamState, serving: bool, detail: str) -> None:
        state.serving = serving
        state.detail = detail
