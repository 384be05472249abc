"""``tandem.v1.GatewayService`` over gRPC, wired to the same :class:`GatewayCore` as HTTP.

Requests go through the same validation as HTTP (bad input → ``INVALID_ARGUMENT``, overload →
``RESOURCE_EXHAUSTED``, unreachable upstream → ``UNAVAILABLE``). A ``Generate`` stream yields one
chunk per batch of committed tokens (text that became printable, and the token ids), then a last
chunk with the finish reason and the usage. When the client cancels, grpc.aio cancels the handler,
and the generation's cleanup releases the target session.

The server also serves ``grpc.health.v1`` (SERVING while the upstreams are ready) and reflection.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass

import grpc
from google.protobuf import json_format

from gateway.auth import ApiKeyInterceptor
from gateway.chat_template import ChatMessage
from gateway.core import GatewayCore
from gateway.errors import GatewayError, InvalidRequest, Overloaded
from gateway.events import Finished, TextDelta, Usage
from gateway.template_options import TemplateOptions
from gateway.validation import RequestFields
from tandem import telemetry
from tandem.rpc import codecs, streams
from tandem.rpc.endpoints import Health, bind, enable_reflection, make_server
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name

_SPECULATION = {
    common_pb2.SPECULATION_MODE_UNSPECIFIED: "auto",
    common_pb2.SPECULATION_MODE_AUTO: "auto",
    common_pb2.SPECULATION_MODE_ON: "on",
    common_pb2.SPECULATION_MODE_OFF: "off",
}
_SMOOTHING = {
    gateway_pb2.STREAM_SMOOTHING_UNSPECIFIED: None,
    gateway_pb2.STREAM_SMOOTHING_OFF: "off",
    gateway_pb2.STREAM_SMOOTHING_AUTO: "auto",
}
_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH}


def fields_from_proto(request: gateway_pb2.GatewayServiceGenerateRequest) -> RequestFields:
    """Proto → the fields shared with HTTP. Exactly one of prompt, prompt_token_ids and messages
    may be set; none set is an empty prompt."""
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(request, name)]
    if len(given) > 1:
        raise InvalidRequest(f"set exactly one of prompt, prompt_token_ids and messages, not {' and '.join(given)}",
                             param=given[1])
    fields = RequestFields(
        model=request.model or None,
        max_tokens=request.max_tokens if request.HasField("max_tokens") else None,
        temperature=request.temperature if request.HasField("temperature") else None,
        top_p=request.top_p if request.HasField("top_p") else None,
        top_k=request.top_k if request.HasField("top_k") else None,
        min_p=request.min_p if request.HasField("min_p") else None,
        typical_p=request.typical_p if request.HasField("typical_p") else None,
        bad_words=tuple(request.bad_words),
        allowed_token_ids=tuple(request.allowed_token_ids) or None,
        seed=request.seed if request.HasField("seed") else None,
        stop=tuple(request.stop),
        stop_token_ids=tuple(request.stop_token_ids),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens if request.HasField("skip_special_tokens") else True,
        min_tokens=request.min_tokens,
        truncate_prompt_tokens=(
            request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
        ),
        # An enum value this build does not know is passed on as a number, which validation refuses.
        speculation=_SPECULATION.get(request.speculation, str(request.speculation)),
        num_speculative_tokens=(
            request.num_speculative_tokens if request.HasField("num_speculative_tokens") else None
        ),
        ignore_eos=request.ignore_eos,
        stream_smoothing=_SMOOTHING.get(request.stream_smoothing, str(request.stream_smoothing)),
        top_logprobs=request.top_logprobs if request.HasField("top_logprobs") else None,
        presence_penalty=request.presence_penalty if request.HasField("presence_penalty") else None,
        frequency_penalty=request.frequency_penalty if request.HasField("frequency_penalty") else None,
        repetition_penalty=request.repetition_penalty if request.HasField("repetition_penalty") else None,
        logit_bias=dict(request.logit_bias),
        prediction=request.prediction or None,
    )
    if request.HasField("grammar"):
        try:
            fields.grammar = codecs.grammar(request.grammar)
        except codecs.WireError as error:
            raise InvalidRequest(str(error), param="grammar") from None
        fields.grammar_param = "grammar"
    fields.template = TemplateOptions(
        request.add_generation_prompt if request.HasField("add_generation_prompt") else True,
        request.continue_final_message,
        json_format.MessageToDict(request.chat_template_kwargs) if request.HasField("chat_template_kwargs") else {},
    )
    if request.messages:
        fields.messages = [ChatMessage(m.role, m.content) for m in request.messages]
    else:
        fields.prompt = list(request.prompt_token_ids) if request.prompt_token_ids else request.prompt
    return fields


def usage_to_proto(usage: Usage) -> gateway_pb2.Usage:
    stats = usage.speculative_decoding
    return gateway_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        accepted_prediction_tokens=stats.prediction_accepted,
        rejected_prediction_tokens=stats.prediction_drafts - stats.prediction_accepted,
        speculative_decoding=gateway_pb2.SpeculativeDecodingStats(
            **{**usage.speculative_decoding.to_json(), "fallback_reason": usage.speculative_decoding.fallback_reason or ""}
        ),
    )


@dataclass
class _Outcome:
    """How a Generate call ended, for its span."""

    usage: Usage | None = None
    finish_reason: str | None = None
    error: BaseException | None = None


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, core: GatewayCore) -> None:
        self._core = core

    async def Generate(self, request: gateway_pb2.GatewayServiceGenerateRequest, context: grpc.aio.ServicerContext):
        # The request's trace span (GenAI conventions), continuing the caller's trace if any; the
        # body runs with it current at every step, so the upstream calls become its children.
        span = telemetry.GenerationSpan.start(
            "chat" if request.messages else "text_completion",
            self._core.model.name,
            carrier=context.invocation_metadata() if telemetry.enabled() else None,
            attributes={"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": "Generate"},
        )
        outcome = _Outcome()
        try:
            async with aclosing(span.stream(self._generate(request, context, span, outcome))) as messages:
                async for message in messages:
                    # A client that stops reading blocks this write; past --stream-stall-timeout-s
                    # the call ends (RESOURCE_EXHAUSTED) and aclosing releases the generation's sessions.
                    await streams.write(context, message, self._core.stream_stall_s)
        except BaseException as exc:
            outcome.error = outcome.error or exc
            raise
        finally:
            span.end(outcome.usage, outcome.finish_reason, outcome.error)

    async def _generate(
        self,
        request: gateway_pb2.GatewayServiceGenerateRequest,
        context: grpc.aio.ServicerContext,
        span: telemetry.GenerationSpan,
        outcome: _Outcome,
    ):
        try:
            # The interceptor let only a valid key through; its id is the request's per-key share.
            key = self._core.keys.check(dict(context.invocation_metadata() or ()).get("authorization"))
            generation = self._core.open(lambda: fields_from_proto(request), key)
        except GatewayError as exc:
            outcome.error = exc
            await context.abort(exc.grpc_code, exc.message, _pushback(exc))
        span.opened(generation.request, generation.session_id)
        async with generation:
            try:
                await generation.start()
                span.first_token()
                async with aclosing(generation.events()) as events:
                    async for event in events:
                        if isinstance(event, TextDelta):
                            yield gateway_pb2.GatewayServiceGenerateResponse(
                                text=event.text,
                                token_ids=event.token_ids,
                                logprobs=codecs.token_logprobs_to_wire(event.logprobs),
                            )
                        elif isinstance(event, Finished):
                            outcome.usage, outcome.finish_reason = event.usage, event.finish_reason
                            yield gateway_pb2.GatewayServiceGenerateResponse(
                                finish_reason=_FINISH[event.finish_reason], usage=usage_to_proto(event.usage)
                            )
            except GatewayError as exc:
                outcome.error = exc
                await context.abort(exc.grpc_code, exc.message, _pushback(exc))
            finally:
                outcome.usage = outcome.usage or generation.usage

    async def Info(self, request: gateway_pb2.GatewayServiceInfoRequest, context: grpc.aio.ServicerContext):
        info = self._core.info()
        return gateway_pb2.GatewayServiceInfoResponse(
            model=info.model,
            draft=info.draft,
            num_speculative_tokens=info.num_speculative_tokens,
            max_context_len=info.max_context_len,
        )


def _pushback(error: GatewayError) -> tuple[tuple[str, str], ...]:
    """gRPC's retry pushback for an overload that says when to retry (a client's retry policy
    honours it)."""
    if isinstance(error, Overloaded) and error.retry_after_s is not None:
        return (("grpc-retry-pushback-ms", str(max(1, round(error.retry_after_s * 1000)))),)
    return ()


def build_grpc_server(
    core: GatewayCore, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.aio.Server, Health, int]:
    """The gRPC server (not started yet), its health servicer (NOT_SERVING until told), and the bound
    port (TLS with ``credentials``). With API keys, GatewayService calls need one (health and
    reflection stay open)."""
    keyed = [ApiKeyInterceptor(core.keys, SERVICE_NAME, core.count_unauthenticated)] if core.keys.enabled else []
    server = make_server(keyed)
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(GatewayServicer(core), server)
    health = Health(server, [SERVICE_NAME])
    enable_reflection(server, [SERVICE_NAME])
    return server, health, bind(server, host, port, credentials)
