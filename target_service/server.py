"""The gRPC face of the engine: ``tandem.v1.TargetService`` as a thin grpc.aio servicer.

Every engine call runs on one dedicated worker thread (``ModelWorker``): forward passes are
serialised, the session store needs no locks, and the event loop stays free to answer health
checks, Info and new streams while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from tandem.models.worker import ModelWorker
from tandem.rpc import streams
from tandem.v1 import target_pb2, target_pb2_grpc
from target_service import wire
from target_service.batcher import PassBatcher
from target_service.engine import DecodeStep, TargetEngine
from target_service.errors import (
    InvalidArgument,
    SessionExists,
    SessionNotFound,
    TargetError,
    TokenizerMismatch,
    TooManySessions,
)
from target_service.types import FinishReason
from target_service.validation import check_session_id

log = logging.getLogger(__name__)

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name  # "tandem.v1.TargetService"

_STATUS_CODES: dict[type[TargetError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    SessionExists: grpc.StatusCode.ALREADY_EXISTS,
    TooManySessions: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TokenizerMismatch: grpc.StatusCode.FAILED_PRECONDITION,
}

T = TypeVar("T")


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    """Wires requests to a ``TargetEngine``; UNAVAILABLE until one is attached (model loading)."""

    def __init__(self, worker: ModelWorker, engine: TargetEngine | None = None) -> None:
        self.worker = worker
        self.engine: TargetEngine | None = None
        self.batcher: PassBatcher | None = None
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: TargetEngine) -> None:
        # Prefill chunks, verify blocks and decode steps of different sessions share passes.
        self.batcher = PassBatcher(self.worker, engine.run_batch, engine.max_batched_tokens)
        self.engine = engine

    async def Info(self, request: target_pb2.TargetServiceInfoRequest, context: grpc.aio.ServicerContext):
        engine = await self._require_engine(context)
        return wire.info_response(engine.info, engine.load(self.batcher.queued))

    async def Prefill(self, request: target_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        engine = await self._require_engine(context)
        try:
            config = wire.session_config(request.params, request.return_hidden_states)
        except InvalidArgument as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if config.grammar is not None:  # compiled here, off the model's thread: its passes go on meanwhile
            await self._answer(context, asyncio.to_thread(engine.grammars.compile, config.grammar))
        job = await self._call(
            context,
            engine.begin_prefill,
            request.session_id,
            list(request.prompt_token_ids),
            config,
            request.tokenizer_fingerprint,
            request.prompt_logprobs,
        )
        # One pass per chunk, shared with the other sessions waiting (a short prompt is one chunk).
        while (result := await self._answer(context, self.batcher.run(job, len(job.next_chunk)))) is None:
            pass
        return wire.prefill_response(result)

    async def Verify(
        self, request_iterator: AsyncIterator[target_pb2.VerifyRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await self._require_engine(context)
        session_id = None  # a Verify stream serves the session its first block names
        async for request in request_iterator:
            block = wire.draft_block(request)
            session_id = session_id or block.session_id
            if block.session_id != session_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"session_id: this Verify stream serves session {session_id[:256]!r}; "
                                    f"open a stream per session")
            verdict = await self._answer(context, self.batcher.run(block, 1 + len(block.draft_token_ids)))
            # A drafter that stops reading verdicts blocks this write; past a while the stream ends.
            await streams.write(context, wire.verify_response(verdict))

    async def Generate(
        self, request: target_pb2.TargetServiceGenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self._require_engine(context)
        await self._check_session_id(context, request.session_id)
        if request.max_new_tokens < 0:
            message = f"max_new_tokens must be >= 0, got {request.max_new_tokens}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        budget = request.max_new_tokens or None  # 0 = until the session finishes
        # Set when the client goes away, so a step in flight does not commit a token nobody sees.
        cancelled = threading.Event()
        sent = 0
        try:
            while budget is None or sent < budget:
                step = DecodeStep(request.session_id, cancelled.is_set)
                result = await self._answer(context, self.batcher.run(step, 1))
                sent += len(result.token_ids)
                await streams.write(context, wire.generate_response(result))
                if result.finish_reason != FinishReason.NONE or not result.token_ids:
                    return
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def Release(self, request: target_pb2.ReleaseRequest, context: grpc.aio.ServicerContext):
        engine = await self._require_engine(context)
        await self._check_session_id(context, request.session_id)
        # Ahead of the queued passes: under load they are seconds of work, and a release stuck
        # behind them times out and leaves the session's cache held until its TTL.
        released = await self._call(context, engine.release, request.session_id, urgent=True)
        return target_pb2.ReleaseResponse(released=released)

    async def _check_session_id(self, context: grpc.aio.ServicerContext, session_id: str) -> None:
        try:
            check_session_id(session_id)
        except InvalidArgument as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    async def _require_engine(self, context: grpc.aio.ServicerContext) -> TargetEngine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the target model is still loading")
        return self.engine

    async def _call(
        self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any, urgent: bool = False
    ) -> T:
        """Runs an engine call on the worker (``urgent``: ahead of the queued calls)."""
        return await self._answer(context, (self.worker.run_soon if urgent else self.worker.run)(fn, *args))

    async def _answer(self, context: grpc.aio.ServicerContext, pending: Awaitable[T]) -> T:
        """The engine's answer; a refusal becomes its gRPC status, a bug INTERNAL."""
        try:
            return await pending
        except TargetError as error:
            code, message = _STATUS_CODES.get(type(error), grpc.StatusCode.INVALID_ARGUMENT), str(error)
        except Exception as error:  # a bug, not bad input: report it and keep serving
            log.exception("target request failed")
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
        await context.abort(code, message)  # raises: ends the RPC with that status
