"""The protocol-independent gateway that the HTTP app and the gRPC server both wire to.

It owns what requests share (served model, validator, admission control, upstream clients,
metrics, health monitor) and turns client fields into a ready-to-start
:class:`gateway.generation.Generation`. Requests refused before any session exists are counted
here in ``tandem_requests_total{status}`` as ``invalid``, ``rejected`` (overload, shutdown) or
``unauthenticated`` (no valid API key, :mod:`gateway.auth`); the others are counted
by their generation as ``stop``, ``length``, ``error`` or ``abort`` (the client went away).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from gateway.admission import AdmissionControl
from gateway.auth import ApiKeys
from gateway.errors import InvalidRequest, Overloaded, ShuttingDown
from gateway.deps import GenerationDeps
from gateway.choices import MAX_CHOICES, Choices, choice_requests
from gateway.generation import Generation
from gateway.monitor import UpstreamMonitor
from gateway.served_model import ServedModel
from gateway.request import GenerationRequest
from gateway.validation import RequestFields, RequestValidator, prompt_batch
from tandem.rpc import streams
from tandem.telemetry.metrics import Metrics


@dataclass(frozen=True)
class GatewayInfo:
    model: str
    draft: str  # the draft model, or the proposer for model-free drafts; "" until the draft answered
    num_speculative_tokens: int
    max_context_len: int


class GatewayCore:
    def __init__(
        self,
        model: ServedModel,
        deps: GenerationDeps,
        validator: RequestValidator,
        admission: AdmissionControl,
        monitor: UpstreamMonitor,
        keys: ApiKeys | None = None,
        metrics_auth: bool = False,
        stream_stall_s: float = streams.STALL_S,
    ) -> None:
        self.model = model
        # How long a streamed response waits for a client that stopped reading (tandem.rpc.streams).
        self.stream_stall_s = stream_stall_s
        # Who may call (gateway.auth): no keys, everybody.
        self.keys = keys if keys is not None else ApiKeys()
        self.metrics_auth = metrics_auth
        self.deps = deps
        self.validator = validator
        self.admission = admission
        self.monitor = monitor
        # Generations in flight, for shutdown (entries vanish once a generation is dropped).
        self._live: weakref.WeakSet[Generation] = weakref.WeakSet()
        self._stopping = False
        self._hurry = False

    @property
    def metrics(self) -> Metrics:
        return self.deps.metrics

    def open(self, read_fields: Callable[[], RequestFields], key: str | None = None) -> Generation:
        """Validates and admits a request; raises InvalidRequest or Overloaded. ``read_fields``
        turns the transport's message into fields (and may refuse it too), so every refusal is
        counted here. ``key``: the id of the request's API key, for its per-key limits. The caller must close the returned generation (``async with``) so that its
        admission slot is freed. A request for several choices (``n``) goes through :meth:`open_choices`."""
        choices = self.open_choices(read_fields, key, most=1)
        return choices.generations[0]

    def open_choices(
        self, read_fields: Callable[[], RequestFields], key: str | None = None, most: int = MAX_CHOICES
    ) -> Choices:
        """:meth:`open` for a request of ``n`` choices (at most ``most``): each is a generation with
        its own admission slot, all admitted or none."""
        received_at = time.monotonic()
        if self._stopping:
            self.metrics.requests.labels(status="rejected").inc()
            raise ShuttingDown("the gateway is shutting down", code="shutting_down")
        try:
            requests = self._validated(read_fields(), most)
        except InvalidRequest:
            self.count_invalid()
            raise
        n = requests[0].n
        tickets = []
        try:
            for _ in range(n * len(requests)):
                tickets.append(self.admission.admit(key))
        except Overloaded:
            for ticket in tickets:
                ticket.release()
            self.metrics.requests.labels(status="rejected").inc()
            raise
        choices = [choice for request in requests for choice in choice_requests(request, n)]
        generations = [Generation(choice, self.deps, ticket, received_at) for choice, ticket in zip(choices, tickets)]
        self._live.update(generations)
        return Choices(generations, per_prompt=n)

    def _validated(self, fields: RequestFields, most: int) -> list[GenerationRequest]:
        """The request of each prompt (one, but for a completions batch: validation.prompt_batch)."""
        batch = prompt_batch(fields)
        if len(batch) > most:  # refused before its prompts are tokenized
            raise InvalidRequest(f"a batch of {len(batch)} prompts asks for more than the {most} choices a request "
                                 "may have here; send the rest in another", param="prompt")
        requests = []
        for i, one in enumerate(batch):
            try:
                requests.append(self.validator.validate(one))
            except InvalidRequest as error:
                if len(batch) == 1 or error.param != "prompt":
                    raise
                raise InvalidRequest(f"prompt[{i}]: {error.message}", param="prompt") from None
        n = requests[0].n
        if n * len(requests) > most and len(requests) == 1:
            raise InvalidRequest(f"n must be at most {most} here, got {n}", param="n")
        if n * len(requests) > most:
            raise InvalidRequest(f"a batch of {len(requests)} prompts with n={n} asks for {n * len(requests)} "
                                 f"choices; at most {most} a request here (send the rest in another)", param="prompt")
        return requests

    async def drain(self, grace: float) -> None:
        """Refuses new requests, lets those in flight finish for up to ``grace`` seconds, then
        interrupts the rest, so their clients get a clear error and their sessions are released."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self._in_flight() and loop.time() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        for generation in self._in_flight():
            generation.interrupt(ShuttingDown("the gateway is shutting down", code="shutting_down"))

    def hurry(self) -> None:
        """Cuts a running :meth:`drain` short (a second Ctrl-C)."""
        self._hurry = True

    def _in_flight(self) -> list[Generation]:
        return [g for g in self._live if not g.closed]

    def count_unauthenticated(self) -> None:
        """Counts a request refused for want of a valid API key."""
        self.metrics.requests.labels(status="unauthenticated").inc()

    def count_invalid(self) -> None:
        """Counts a request refused as invalid before it reached :meth:`open`."""
        self.metrics.requests.labels(status="invalid").inc()

    def info(self) -> GatewayInfo:
        draft = self.monitor.draft_info
        return GatewayInfo(
            model=self.model.name,
            draft=(draft.model_name or draft.proposer) if draft is not None else "",
            num_speculative_tokens=self.deps.default_num_speculative_tokens,
            max_context_len=self.model.max_context_len,
        )
