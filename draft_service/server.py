"""gRPC wiring of ``tandem.v1.DraftService``: proto in, engine, proto out, errors to status codes.

Nothing here decides anything about speculation; see ``engine.py`` and ``loop.py``.

A call that fails because of its target (the target's own status, passed through, or a verdict
that breaks the Verify contract) carries trailing metadata saying so: ``tandem-failed-hop:
target`` and ``tandem-target-address: host:port``. A gateway in front of pools tells a dead target
(move the session to another target) from a dead draft (move it to another draft) by them. A call
naming a target outside the draft's pool is refused (INVALID_ARGUMENT) with ``tandem-failed-hop:
unknown-target``: a gateway then places the leg on a draft that serves that target.
"""

from __future__ import annotations

import logging
from contextlib import aclosing

import grpc

from draft_service import wire
from draft_service.engine import DraftEngine
from draft_service.errors import (
    DivergedError,
    InvalidRequestError,
    ProtocolError,
    SessionBusyError,
    TokenizerMismatchError,
    UnknownTargetError,
)
from draft_service.validation import validate_spec
from tandem import telemetry
from tandem.rpc import streams
from tandem.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name  # "tandem.v1.DraftService"

#: Trailing metadata of a Speculate call failed by its target: the hop that failed, and which target.
FAILED_HOP_KEY = "tandem-failed-hop"
FAILED_HOP_TARGET = "target"
FAILED_HOP_UNKNOWN_TARGET = "unknown-target"  # the target named is not one of this draft's
TARGET_ADDRESS_KEY = "tandem-target-address"

_STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,  # UnknownTargetError: the target named is no member
    TokenizerMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    SessionBusyError: grpc.StatusCode.ALREADY_EXISTS,
    DivergedError: grpc.StatusCode.ABORTED,
}


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Answers UNAVAILABLE until ``attach`` hands it the engine (the server binds before the
    proposer is loaded and the target checked, while health still says NOT_SERVING)."""

    def __init__(self) -> None:
        self._engine: DraftEngine | None = None

    def attach(self, engine: DraftEngine) -> None:
        self._engine = engine

    async def Info(self, request: draft_pb2.DraftServiceInfoRequest, context: grpc.aio.ServicerContext):
        engine = await self._ready(context)
        return draft_pb2.DraftServiceInfoResponse(
            proposer=engine.proposer.kind,
            model_name=engine.proposer.model_name,
            tokenizer_fingerprint=engine.proposer.tokenizer_fingerprint,
            num_speculative_tokens=engine.default_k,
            target_model_name=engine.target_info.model_name,
            active_sessions=len(engine.active_sessions),
        )

    async def Speculate(self, request: draft_pb2.SpeculateRequest, context: grpc.aio.ServicerContext) -> None:
        engine = await self._ready(context)
        spec = wire.spec_from_request(request, engine.default_k)
        try:
            validate_spec(spec, engine.target_info)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            # aclosing: when this handler is cancelled (client gone) the engine's generator is
            # closed right away, which frees the session and releases it in the target.
            # One span event per verified round (aggregated past a limit) on this call's span.
            round_events = telemetry.RoundEvents.for_current_span()
            try:
                async with aclosing(engine.speculate(spec)) as rounds:
                    async for result in rounds:
                        if result.verified:
                            round_events.record(result.num_draft_tokens, result.num_accepted, result.verify_seconds)
                        await streams.write(context, wire.speculate_response(result))
            finally:
                round_events.finish()
            return
        except grpc.aio.AioRpcError as exc:  # the target's error, passed through unchanged
            code, details = exc.code(), exc.details() or ""
            trailers = _target_failed(engine.target_address_of(spec))
        except ProtocolError as exc:  # the target broke the Verify contract
            log.error("Speculate for session %r: %s", spec.session_id, exc)
            code, details = grpc.StatusCode.INTERNAL, f"target {engine.target_address_of(spec)}: {exc}"
            trailers = _target_failed(engine.target_address_of(spec))
        except UnknownTargetError as exc:  # said so, so that a gateway places the leg on another draft
            code, details = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
            trailers = ((FAILED_HOP_KEY, FAILED_HOP_UNKNOWN_TARGET), (TARGET_ADDRESS_KEY, spec.target_address))
        except tuple(_STATUS_OF) as exc:
            code, details, trailers = _status_of(exc), str(exc), ()
        except Exception as exc:
            log.exception("Speculate for session %r failed", spec.session_id)
            code, details, trailers = grpc.StatusCode.INTERNAL, f"draft service error: {exc}", ()
        await context.abort(code, details, trailing_metadata=trailers)

    async def _ready(self, context: grpc.aio.ServicerContext) -> DraftEngine:
        if self._engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the draft service is still starting")
        return self._engine


def _status_of(exc: Exception) -> grpc.StatusCode:
    return next(code for kind, code in _STATUS_OF.items() if isinstance(exc, kind))


def _target_failed(address: str) -> tuple[tuple[str, str], ...]:
    return ((FAILED_HOP_KEY, FAILED_HOP_TARGET), (TARGET_ADDRESS_KEY, address))
