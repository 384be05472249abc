"""The OpenAI-compatible HTTP API (DESIGN §3): FastAPI routes wired to :class:`GatewayCore`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
(:mod:`gateway.responses_api`), ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /tokenize``
and ``/detokenize`` (:mod:`gateway.tokenize`), ``GET /health`` (200 when target and draft are
serving, else 503; the body reports each) and ``GET /metrics`` (Prometheus text of the gateway's
registry). Every error, FastAPI's own included (malformed JSON, wrong types, unknown routes), is
answered with OpenAI's error JSON; see :mod:`gateway.errors` for the status codes.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import tandem
from gateway import openai_api, responses_output
from gateway.choices import Choices
from gateway.core import GatewayCore
from gateway.errors import GatewayError, Overloaded, Unauthenticated, openai_error
from gateway.http_util import ClientDisconnected, ClosingStreamingResponse, cancel_on_disconnect, invalid_body
from gateway.openai_api import ResponseMeta
from gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from gateway.responses_api import ResponsesRequest
from gateway.responses_output import ResponseShape
from gateway.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)
from gateway.validation import RequestFields
from tandem import telemetry

# nginx's "client closed request": logged, never seen by the departed client.
CLIENT_CLOSED_REQUEST = 499

# The GenAI semantic-convention operation of each endpoint (gen_ai.operation.name).
_OPERATIONS = {"chat": "chat", "completion": "text_completion"}
# What a client that asked for another route (embeddings, images, audio, ...) is told (docs/api.md).
ROUTES = ("this server serves POST /v1/chat/completions, /v1/completions, /v1/responses, /tokenize, /detokenize "
          "and GET /v1/models, /health, /metrics")


def error_response(error: GatewayError) -> JSONResponse:
    headers = {}
    if isinstance(error, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"  # RFC 9110: a 401 says which scheme would do
    if isinstance(error, Overloaded) and error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return JSONResponse(error.to_openai(), status_code=error.http_status, headers=headers or None)


def _without_framework_tracing() -> dict[str, Any]:
    """FastAPI releases with built-in OpenTelemetry would open their own HTTP server span (and
    spans per dependency) beside the gateway's request span; the gateway's span is the server
    span of a generation (see :func:`_generate`), so theirs is turned off where it exists."""
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "operation_spans": False}}
    return {}


def create_app(core: GatewayCore) -> FastAPI:
    app = FastAPI(title="tandem gateway", version=tandem.__version__, **_without_framework_tracing())
    started = int(time.time())

    async def authorized(request: Request) -> None:
        """Refuses a request without a valid API key when the gateway has keys (gateway.auth)."""
        try:
            request.state.key_id = core.keys.check(request.headers.get("authorization"))
        except Unauthenticated:
            core.count_unauthenticated()
            raise

    keyed = [Depends(authorized)]

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI parses the body before the key dependency runs: a caller without a valid key
        # learns nothing of what the body lacks, it gets the 401 it would have got anyway.
        try:
            core.keys.check(request.headers.get("authorization"))
        except Unauthenticated as refused:
            core.count_unauthenticated()
            return error_response(refused)
        core.count_invalid()
        return error_response(invalid_body(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = str(exc.detail)
        if exc.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):  # the router's own
            message = f"{request.method} {request.url.path} is not served here; {ROUTES}"
        body = openai_error(message, error_type, code=str(exc.status_code))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=keyed)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletionResponse:
        meta = ResponseMeta("chat", core.model.name, body.include_usage, strings=core.model.strings)
        return await _generate(core, body.to_fields, _OpenAIShape(meta), body.stream, request)

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=keyed)
    async def completions(body: CompletionRequest, request: Request) -> Response | CompletionResponse:
        meta = ResponseMeta("completion", core.model.name, body.include_usage, strings=core.model.strings,
                            echo=body.echo)
        return await _generate(core, body.to_fields, _OpenAIShape(meta), body.stream, request)

    @app.post("/v1/responses", dependencies=keyed)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        shape = ResponseShape(core.model.name, None, body.max_output_tokens, body.temperature, body.top_p,
                              strings=core.model.strings)
        return await _generate(core, body.to_fields, _ResponsesShape(shape), body.stream, request)

    @app.get("/v1/responses/{response_id}", dependencies=keyed)
    async def stored_response(response_id: str) -> JSONResponse:
        body = openai_error(f"no response {response_id!r}: this server stores no responses (store is not kept)",
                            "invalid_request_error", "response_id", "not_found")
        return JSONResponse(body, status_code=404)

    def model_card() -> ModelCard:
        return ModelCard(id=core.model.name, created=started, max_model_len=core.model.max_context_len)

    @app.get("/v1/models", response_model=ModelList, dependencies=keyed)
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, dependencies=keyed)
    async def model(model_id: str) -> ModelCard | JSONResponse:
        if model_id != core.model.name:
            # A lookup of a resource that does not exist: 404, as OpenAI answers it.
            body = openai_error(f"the model {model_id!r} does not exist", "invalid_request_error", "model",
                                "model_not_found")
            return JSONResponse(body, status_code=404)
        return model_card()

    @app.post("/tokenize", response_model=TokenizeResponse, dependencies=keyed)
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return tokenize(body, core.model, core.validator)

    @app.post("/detokenize", response_model=DetokenizeResponse, dependencies=keyed)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return detokenize(body, core.model, core.validator)

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = await core.monitor.check()
        body = {
            "status": "ok" if ready else "unavailable",
            "model": core.model.name,
            "target": core.monitor.targets.to_json(),
            "draft": core.monitor.drafts.to_json(),
        }
        for member in body["draft"]["members"]:  # what placement goes by: tokens/s by target
            member["tokens_per_s"] = core.deps.draft_speeds.to_json(member["address"])
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics", dependencies=keyed if core.metrics_auth else [])
    async def metrics() -> Response:
        return Response(generate_latest(core.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _OpenAIShape:
    """Chat and completions objects (gateway.openai_api)."""

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta, self.operation, self.id = meta, _OPERATIONS[meta.kind], meta.id

    def events(self, choices: Choices) -> AsyncIterator[str]:
        return openai_api.stream(choices, self.meta)

    async def whole(self, choices: Choices) -> Any:
        return await openai_api.complete(choices, self.meta)


class _ResponsesShape:
    """Responses API objects (gateway.responses_output); what the request asked for (its tools)
    is known once it is validated."""

    operation = "chat"

    def __init__(self, shape: ResponseShape) -> None:
        self.shape, self.id = shape, shape.id

    def events(self, choices: Choices) -> AsyncIterator[str]:
        self.shape.calling = choices.generations[0].request.tool_calling
        return responses_output.stream(choices, self.shape)

    async def whole(self, choices: Choices) -> Any:
        self.shape.calling = choices.generations[0].request.tool_calling
        return JSONResponse(await responses_output.complete(choices, self.shape))


async def _generate(
    core: GatewayCore,
    read_fields: Callable[[], RequestFields],
    shape: _OpenAIShape | _ResponsesShape,
    stream: bool,
    request: Request,
) -> Response | ChatCompletionResponse | CompletionResponse:
    # The request's trace span: continues the client's trace when it sent a traceparent header.
    span = telemetry.GenerationSpan.start(
        shape.operation,
        core.model.name,
        carrier=request.headers if telemetry.enabled() else None,
        attributes={"http.request.method": request.method, "url.path": request.url.path,
                    "gen_ai.response.id": shape.id},
    )
    try:
        with span.active():
            generation = core.open_choices(read_fields, getattr(request.state, "key_id", None))
    except BaseException as exc:
        span.end(error=exc)
        raise
    span.opened(generation.request, generation.session_id)
    try:
        # Prefill before answering, so a failing upstream still gets a proper error status; a
        # client that leaves meanwhile cancels it (a long prompt's prefill is seconds of target time).
        with span.active():
            await cancel_on_disconnect(request.receive, generation.start())
    except ClientDisconnected:
        with span.active():
            await generation.aclose()
        span.end(generation.usage)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except BaseException as exc:
        with span.active():
            await generation.aclose()
        span.end(generation.usage, error=exc)
        raise
    span.first_token()
    if stream:

        async def close() -> None:
            with span.active():  # the session release is part of the request's trace
                await generation.aclose()
            span.end(generation.usage)

        return ClosingStreamingResponse(span.stream(shape.events(generation)), on_close=close,
                                        stall_s=core.stream_stall_s)
    try:
        with span.active():
            async with generation:
                try:
                    response = await cancel_on_disconnect(request.receive, shape.whole(generation))
                except ClientDisconnected:
                    response = Response(status_code=CLIENT_CLOSED_REQUEST)
    except BaseException as exc:
        span.end(generation.usage, error=exc)
        raise
    choices = getattr(response, "choices", None)
    span.end(generation.usage, choices[0].finish_reason if choices else None)
    return response
