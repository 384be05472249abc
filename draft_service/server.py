"""gRPC wiring of ``tandem.v1.DraftService``: proto in, engine, proto out, errors to status codes.

Nothing here decides anything about speculation; see ``engine.py`` and ``loop.py``.
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
    SessionBusyError,
    TokenizerMismatchError,
)
from draft_service.validation import validate_spec
from tandem import telemetry
from tandem.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name  # "tandem.v1.DraftService"

_STATUS_OF = {
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
                        await context.write(wire.speculate_response(result))
            finally:
                round_events.finish()
            return
        except grpc.aio.AioRpcError as exc:  # the target's error, passed through unchanged
            code, details = exc.code(), exc.details() or ""
        except (TokenizerMismatchError, SessionBusyError, DivergedError) as exc:
            code, details = _STATUS_OF[type(exc)], str(exc)
        except Exception as exc:
            log.exception("Speculate for session %r failed", spec.session_id)
            code, details = grpc.StatusCode.INTERNAL, f"draft service error: {exc}"
        await context.abort(code, details)

    async def _ready(self, context: grpc.aio.ServicerContext) -> DraftEngine:
        if self._engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the draft service is still starting")
        return self._engine
