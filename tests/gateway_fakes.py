"""Test doubles for the gateway tests: a scripted target and draft, in memory or over gRPC.

(Named ``test_gateway_*`` to sit with the gateway's tests; it holds no tests itself. The other
``test_gateway_*`` modules import its fixtures.)

The real target and draft services are heavy and developed separately; the gateway only sees
their wire behaviour, which these doubles reproduce from a fixed script: every session continues
its prompt with the tokens of :data:`SCRIPT_TEXT`, then EOS (or the script again and again with
``ignore_eos``), honouring ``max_new_tokens`` and ``stop_token_ids``. The draft double commits
``K // 2 + 1`` tokens per round (K // 2 accepted plus one) directly in the shared script state,
as if it had verified blocks with the target.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from gateway.errors import UpstreamUnavailable
from gateway.main import RunningGateway, start_gateway
from tandem.tools.bench.stack import free_port
from tandem.config import GatewaySettings
from tandem.rpc.endpoints import Health, bind, make_server
from tandem.models import load_tokenizer, tokenizer_fingerprint
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

# Multi-byte characters that the tiny byte-level tokenizer splits across tokens.
SCRIPT_TEXT = "Hello wörld ✓ 日本語 🙂 The quick brown fox."
MAX_CONTEXT_LEN = 128
FAKE_TARGET_NAME = "fake-target"


def prompt_value(position: int) -> float:
    """The fake target's log-probability of prompt token ``position`` (> 0)."""
    return -1.0 - 0.5 * (position % 3)


@dataclass
class FakeSession:
    prompt: list[int]
    params: common_pb2.SessionParams
    generated: list[int] = field(default_factory=list)
    finish: int = common_pb2.FINISH_REASON_UNSPECIFIED
    # Script tokens the prompt already ends with (a session prefilled again mid-script by a resync).
    offset: int = 0

    @property
    def committed_len(self) -> int:
        return len(self.prompt) + len(self.generated)


class ScriptedModel:
    """Shared state of the fake target: sessions that all continue with the same script."""

    def __init__(self, tokenizer: Any, token_delay: float = 0.0) -> None:
        self.script = tokenizer(SCRIPT_TEXT, add_special_tokens=False)["input_ids"]
        self.eos_id = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.token_delay = token_delay
        self.sessions: dict[str, FakeSession] = {}
        self.released: list[str] = []
        self.prefilled: list[common_pb2.SessionParams] = []  # every Prefill's, in order
        self.prefilled_prompts: list[tuple[int, ...]] = []  # and its prompt
        self.rpcs: list[tuple[str, str]] = []  # (rpc name, session id)
        self.speculate_requests: list[draft_pb2.SpeculateRequest] = []
        self.cancelled_speculations: list[str] = []
        self.prefill_delay = 0.0  # seconds each Prefill takes (a long prompt)
        self.cached_tokens = 0  # prompt tokens each Prefill says came from its prefix cache (at most all but one)
        self.cancelled_prefills: list[str] = []

    def expected_tokens(self, n: int, ignore_eos: bool = False) -> list[int]:
        """The first n tokens any session produces (fewer when EOS ends it first)."""
        out: list[int] = []
        while len(out) < n:
            i = len(out)
            if ignore_eos:
                out.append(self.script[i % len(self.script)])
            elif i < len(self.script):
                out.append(self.script[i])
            else:
                out.append(self.eos_id)
                break
        return out

    def prefill(self, session_id: str, prompt: list[int], params: common_pb2.SessionParams) -> FakeSession:
        self.rpcs.append(("Prefill", session_id))
        self.prefilled.append(params)
        self.prefilled_prompts.append(tuple(prompt))
        session = self.sessions[session_id] = FakeSession(list(prompt), params)
        session.offset = next(
            (n for n in range(len(prompt) - 1, 0, -1) if prompt[-n:] == self.expected_tokens(n, params.ignore_eos)), 0
        )
        self.commit(session_id, 1)
        return session

    def commit(self, session_id: str, n: int) -> tuple[list[int], FakeSession]:
        """Commits up to n more tokens of the script; returns them and the session."""
        session = self.sessions[session_id]
        new: list[int] = []
        while len(new) < n and session.finish == common_pb2.FINISH_REASON_UNSPECIFIED:
            i = session.offset + len(session.generated)
            if session.params.ignore_eos:
                token = self.script[i % len(self.script)]
            else:
                token = self.script[i] if i < len(self.script) else self.eos_id
            session.generated.append(token)
            new.append(token)
            if (token == self.eos_id and not session.params.ignore_eos) or token in session.params.stop_token_ids:
                session.finish = common_pb2.FINISH_REASON_STOP
            elif len(session.generated) >= session.params.max_new_tokens:
                session.finish = common_pb2.FINISH_REASON_LENGTH
        return new, session

    def logprobs(self, session: FakeSession, tokens: list[int]) -> list[common_pb2.TokenLogprobs]:
        """Made-up log-probabilities of the session's last ``tokens`` when it asked for them: the
        token's value is -0.25 times its position modulo 4, its alternatives the next ids, each 1 less."""
        if not session.params.HasField("top_logprobs"):
            return []
        found = []
        for position in range(len(session.generated) - len(tokens), len(session.generated)):
            token, value = session.generated[position], -0.25 * (position % 4)
            top = [(token + i) % self.vocab_size for i in range(session.params.top_logprobs)]
            found.append(common_pb2.TokenLogprobs(logprob=value, top_token_ids=top,
                                                  top_logprobs=[value - i for i in range(len(top))]))
        return found

    def prefill_response(self, session: FakeSession, prompt_logprobs: bool = False) -> target_pb2.PrefillResponse:
        """``prompt_logprobs``: made up for prompt token i > 0 as ``prompt_value(i)``, its one
        alternative the token itself."""
        logprobs = self.logprobs(session, session.generated[:1])
        scored = [
            common_pb2.TokenLogprobs(logprob=prompt_value(i), top_token_ids=[token], top_logprobs=[prompt_value(i)])
            for i, token in enumerate(session.prompt) if i
        ] if prompt_logprobs else []
        return target_pb2.PrefillResponse(
            token_id=session.generated[0], committed_len=session.committed_len, finish_reason=session.finish,
            logprobs=logprobs[0] if logprobs else None, cached_tokens=min(self.cached_tokens, len(session.prompt) - 1),
            prompt_logprobs=scored,
        )

    def release(self, session_id: str) -> bool:
        self.rpcs.append(("Release", session_id))
        self.released.append(session_id)
        return self.sessions.pop(session_id, None) is not None

    # Streams both the gRPC servicers and the in-memory clients serve.

    async def generate_stream(
        self, session_id: str, max_new_tokens: int = 0
    ) -> AsyncIterator[target_pb2.TargetServiceGenerateResponse]:
        self.rpcs.append(("Generate", session_id))
        sent = 0
        while not max_new_tokens or sent < max_new_tokens:
            await asyncio.sleep(self.token_delay)
            tokens, session = self.commit(session_id, 1)
            sent += len(tokens)
            yield target_pb2.TargetServiceGenerateResponse(
                token_ids=tokens, committed_len=session.committed_len, finish_reason=session.finish,
                logprobs=self.logprobs(session, tokens),
            )
            if session.finish:
                return

    async def speculate_stream(self, request: draft_pb2.SpeculateRequest) -> AsyncIterator[draft_pb2.SpeculateResponse]:
        self.rpcs.append(("Speculate", request.session_id))
        self.speculate_requests.append(request)
        k = request.num_speculative_tokens
        accepted = k // 2
        sent = 0
        while not request.max_new_tokens or sent < request.max_new_tokens:
            await asyncio.sleep(self.token_delay)
            budget = request.max_new_tokens - sent if request.max_new_tokens else accepted + 1
            tokens, session = self.commit(request.session_id, min(accepted + 1, budget))
            sent += len(tokens)
            yield draft_pb2.SpeculateResponse(
                token_ids=tokens,
                committed_len=session.committed_len,
                finish_reason=session.finish,
                num_draft_tokens=k,
                num_accepted=min(accepted, len(tokens)),
                logprobs=self.logprobs(session, tokens),
            )
            if session.finish:
                return


# ---- over gRPC ------------------------------------------------------------------------------


class FakeTargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, model: ScriptedModel, max_context_len: int = MAX_CONTEXT_LEN) -> None:
        self.model = model
        self.max_context_len = max_context_len

    async def Info(self, request, context):
        return target_pb2.TargetServiceInfoResponse(
            model_name=FAKE_TARGET_NAME,
            vocab_size=self.model.vocab_size,
            tokenizer_fingerprint=self.model.fingerprint,
            max_context_len=self.max_context_len,
            eos_token_ids=[self.model.eos_id],
        )

    async def Prefill(self, request, context):
        if request.tokenizer_fingerprint != self.model.fingerprint:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "tokenizer fingerprint mismatch")
        if self.model.prefill_delay:
            try:
                await asyncio.sleep(self.model.prefill_delay)
            except asyncio.CancelledError:
                self.model.cancelled_prefills.append(request.session_id)
                raise
        session = self.model.prefill(request.session_id, list(request.prompt_token_ids), request.params)
        return self.model.prefill_response(session, request.prompt_logprobs)

    async def Generate(self, request, context):
        async for response in self.model.generate_stream(request.session_id, request.max_new_tokens):
            yield response

    async def Release(self, request, context):
        return target_pb2.ReleaseResponse(released=self.model.release(request.session_id))


class FakeDraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """``fail_after_rounds``: Speculate aborts with INTERNAL after that many rounds (None: never)."""

    def __init__(self, model: ScriptedModel, fail_after_rounds: int | None = None) -> None:
        self.model = model
        self.fail_after_rounds = fail_after_rounds

    async def Info(self, request, context):
        return draft_pb2.DraftServiceInfoResponse(proposer="fake", num_speculative_tokens=4)

    async def Speculate(self, request, context):
        try:
            rounds = 0
            async for response in self.model.speculate_stream(request):
                if rounds == self.fail_after_rounds:
                    await context.abort(grpc.StatusCode.INTERNAL, "the fake draft broke down")
                rounds += 1
                yield response
        except (asyncio.CancelledError, GeneratorExit):  # cancelled while waiting, or closed at a yield
            self.model.cancelled_speculations.append(request.session_id)
            raise


async def speculations_cancelled(model: ScriptedModel, timeout_s: float = 5.0) -> list[str]:
    """The sessions whose Speculate the draft fake saw cancelled, once it has seen one: its handler
    learns of a cancelled call over the network, maybe after the gateway released the session."""
    for _ in range(int(timeout_s / 0.05)):
        if model.cancelled_speculations:
            break
        await asyncio.sleep(0.05)
    return model.cancelled_speculations


async def serve_fake(add_servicer, servicer, service_name: str, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = make_server()
    add_servicer(servicer, server)
    health = Health(server, [service_name])
    port = bind(server, "127.0.0.1", port)
    await server.start()
    await health.serving()
    return server, port


# ---- in memory (no sockets), for driving gateway.generation directly ------------------------


class InMemoryStream:
    def __init__(self, source: AsyncIterator[Any]) -> None:
        self._source = source
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._source

    def cancel(self) -> None:
        self.cancelled = True


class InMemoryTarget:
    def __init__(self, model: ScriptedModel) -> None:
        self.model = model
        self.streams: list[InMemoryStream] = []
        self.serving = True  # what its health check answers

    async def is_serving(self, timeout: float) -> bool:
        return self.serving

    async def prefill(self, request: target_pb2.PrefillRequest) -> target_pb2.PrefillResponse:
        session = self.model.prefill(request.session_id, list(request.prompt_token_ids), request.params)
        return self.model.prefill_response(session, request.prompt_logprobs)

    def generate(self, request: target_pb2.TargetServiceGenerateRequest) -> InMemoryStream:
        self.streams.append(InMemoryStream(self.model.generate_stream(request.session_id, request.max_new_tokens)))
        return self.streams[-1]

    async def release(self, session_id: str) -> bool:
        return self.model.release(session_id)


class InMemoryDraft:
    """``fail_after_rounds``: the draft becomes unreachable after that many rounds (None: never)."""

    def __init__(self, model: ScriptedModel, fail_after_rounds: int | None = None) -> None:
        self.model = model
        self.fail_after_rounds = fail_after_rounds
        self.streams: list[InMemoryStream] = []

    def speculate(self, request: draft_pb2.SpeculateRequest) -> InMemoryStream:
        self.streams.append(InMemoryStream(self._rounds(request)))
        return self.streams[-1]

    async def _rounds(self, request: draft_pb2.SpeculateRequest) -> AsyncIterator[draft_pb2.SpeculateResponse]:
        source = self.model.speculate_stream(request)
        rounds = 0
        while self.fail_after_rounds is None or rounds < self.fail_after_rounds:
            try:
                response = await anext(source)
            except StopAsyncIteration:
                return
            rounds += 1
            yield response
        raise UpstreamUnavailable("the draft service (in memory) is unavailable")


# ---- a whole fake stack: fake target + fake draft over gRPC, the real gateway in front -------


@dataclass
class FakeStack:
    model: ScriptedModel
    gateway: RunningGateway

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.gateway.grpc_port}"

    def metric(self, name: str, **labels: str) -> float:
        value = self.gateway.core.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def sessions_active(self) -> float:
        return sum(self.metric("tandem_sessions_active", mode=m) for m in ("speculative", "autoregressive"))

    async def wait_until_idle(self, timeout: float = 5.0) -> None:
        """Until no session is active and every session was released (cleanup is asynchronous)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.sessions_active() or self.model.sessions or self.gateway.core.admission.in_flight:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(
                    f"not idle: active={self.sessions_active()} sessions={list(self.model.sessions)} "
                    f"in_flight={self.gateway.core.admission.in_flight}"
                )
            await asyncio.sleep(0.01)


@asynccontextmanager
async def fake_stack(
    tokenizer: Any,
    target_model: str,
    *,
    draft_up: bool = True,
    draft_fails_after_rounds: int | None = None,
    token_delay: float = 0.0,
    health_interval_s: float = 0.2,
    max_context_len: int = MAX_CONTEXT_LEN,
    **settings: Any,
) -> AsyncIterator[FakeStack]:
    model = ScriptedModel(tokenizer, token_delay=token_delay)
    target_server, target_port = await serve_fake(
        target_pb2_grpc.add_TargetServiceServicer_to_server, FakeTargetServicer(model, max_context_len), "tandem.v1.TargetService"
    )
    servers = [target_server]
    if draft_up:
        draft_server, draft_port = await serve_fake(
            draft_pb2_grpc.add_DraftServiceServicer_to_server, FakeDraftServicer(model, draft_fails_after_rounds),
            "tandem.v1.DraftService",
        )
        servers.append(draft_server)
    else:
        draft_port = free_port()
    config = dict(
        target_model=target_model,
        target_address=f"127.0.0.1:{target_port}",
        draft_address=f"127.0.0.1:{draft_port}",
        http_port=0,
        grpc_port=0,
        num_speculative_tokens=4,
        default_max_tokens=32,
        log_level="warning",
        # The fake draft's acceptance (K // 2 of K) is below the default bar and its timings are
        # meaningless, and most requests here leave the temperature at OpenAI's default of 1:
        # tests of the fallback policies (test_fallback_*) turn them on.
        fallback_adaptive=False,
        fallback_max_temperature=2.0,
        draft_breaker_cooldown_s=0.0,
    )
    config.update(settings)
    try:
        gateway = await start_gateway(GatewaySettings(**config), tokenizer, health_interval_s=health_interval_s,
                                      max_context_len=max_context_len)
    except BaseException:  # a start refused (SystemExit): the fake upstreams go too
        for server in servers:
            await server.stop(None)
        raise
    try:
        yield FakeStack(model, gateway)
    finally:
        await gateway.stop()
        for server in servers:
            await server.stop(None)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    return load_tokenizer(str(tiny_dir))


@pytest.fixture
async def stack(tokenizer, tiny_dir) -> AsyncIterator[FakeStack]:
    async with fake_stack(tokenizer, str(tiny_dir)) as running:
        yield running
