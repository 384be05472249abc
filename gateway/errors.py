"""Errors the gateway reports to clients, each knowing its HTTP status and gRPC code.

HTTP and gRPC wiring map any :class:`GatewayError` the same way, so a given failure reads the
same over both APIs. The HTTP body is OpenAI's error JSON:
``{"error": {"message", "type", "param", "code"}}``.

Status choices (documented once, here):

* bad input of any kind (malformed JSON, wrong types, missing fields, out-of-range values) is
  **400** ``invalid_request_error`` / ``INVALID_ARGUMENT``; 422 is never used.
* an unknown model is **404** ``invalid_request_error`` with code ``model_not_found``, as OpenAI's
  API and vLLM answer it (DESIGN §4.3; the SDKs raise their NotFoundError); over gRPC it is bad
  input like the rest, ``INVALID_ARGUMENT``.
* a missing or wrong API key (where keys are required) is **401** ``invalid_request_error`` with
  code ``invalid_api_key``, as OpenAI answers it / ``UNAUTHENTICATED``.
* too many requests in flight is **429** / ``RESOURCE_EXHAUSTED``.
* an unreachable upstream (target or draft service), or a gateway that is shutting down, is
  **503** / ``UNAVAILABLE``; any other upstream failure is **502** / ``INTERNAL``.
"""

from __future__ import annotations

from typing import Any

import grpc


def openai_error(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON body."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class GatewayError(Exception):
    """Base class: a failure with a client-facing message."""

    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict[str, Any]:
        return openai_error(self.message, self.error_type, self.param, self.code)


class InvalidRequest(GatewayError):
    """The request cannot be served as sent; the client must change it."""

    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    error_type = "invalid_request_error"


class ModelNotFound(InvalidRequest):
    """A request for a model this server does not serve."""

    http_status = 404

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model", code="model_not_found")


class Overloaded(GatewayError):
    """More requests are in flight than the gateway admits; the client may retry later (after
    ``retry_after_s`` when it is known)."""

    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class UpstreamUnavailable(GatewayError):
    """The target or draft service cannot be reached."""

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "server_error"


class ShuttingDown(GatewayError):
    """The gateway is stopping: new requests are refused and unfinished ones are ended."""

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "server_error"


class UpstreamFailure(GatewayError):
    """The target or draft service answered with an error, or broke the wire contract."""

    http_status = 502
    grpc_code = grpc.StatusCode.INTERNAL
    error_type = "server_error"


class TargetLost(UpstreamUnavailable):
    """The target that holds a session died, hung or lost the session: the session moves to
    another target (:mod:`gateway.target_session`). ``reason`` labels
    ``tandem_session_failovers_total``: ``unavailable`` (connection lost or refused), ``timeout``
    (silent past ``--target-timeout-s`` and failing its health check too) or ``session_lost``
    (the target no longer knows the session, e.g. it restarted)."""

    def __init__(self, message: str, *, reason: str, address: str) -> None:
        super().__init__(message, code="upstream_unavailable")
        self.reason = reason
        self.address = address


class TargetNotServed(UpstreamUnavailable):
    """A draft refused a leg because the session's target is not one of its targets (its
    ``--target-address``): a configuration, not an outage. The leg goes to another draft
    (:mod:`gateway.leg_reader`); with none that serves the target, the client gets this (503)."""

    def __init__(self, message: str, *, draft: str, target: str) -> None:
        super().__init__(message, code="upstream_unavailable")
        self.draft = draft
        self.target = target


class Unauthenticated(GatewayError):
    """A request without a valid API key, where the gateway requires one (:mod:`gateway.auth`)."""

    http_status = 401
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")
