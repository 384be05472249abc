"""Running the gateway: HTTP (uvicorn) and gRPC in one event loop.

* :func:`run` — blocking entry point for ``tandem gateway`` / ``tandem serve``: loads the target's
  tokenizer, serves until SIGINT or SIGTERM, then stops cleanly (in-flight sessions released).
* :func:`start_gateway` — the same, started inside a running event loop and returned as a
  :class:`RunningGateway`; with ports 0 (and a tokenizer passed in) it is what tests use.

Upstream addresses, ports and limits all come from :class:`tandem.config.GatewaySettings`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
import uvicorn

from gateway.admission import AdmissionControl
from gateway.auth import ApiKeys
from gateway.breaker import BreakerConfig, DraftBreaker
from gateway.chat_template import ChatMessage, load_template
from gateway.core import GatewayCore
from gateway.deps import GenerationDeps, SessionTuning
from gateway.draft_speeds import DraftSpeeds
from gateway.grpc_server import build_grpc_server
from gateway.http_app import create_app
from gateway.monitor import UpstreamMonitor
from gateway.policy import PolicyConfig, SpeculationPolicy
from gateway.prior import TemperaturePrior
from gateway.sampling_defaults import SamplingDefaults
from gateway.served_model import ServedModel, config_context_len
from gateway.pool import Member, Pool
from gateway.upstream import GrpcDraft, GrpcTarget
from gateway.validation import RequestValidator
from tandem import telemetry
from tandem.config import GatewaySettings
from tandem.rpc.endpoints import Health
from tandem.rpc.security import HopSecurity, for_service
from tandem.telemetry.metrics import Metrics, make_metrics
from tandem.models import default_served_name, resolve
from tandem.models.tokenizer_facts import TokenizerLoader, tokenizer_facts

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 2.0
# In-flight requests get this long to finish when the gateway stops.
SHUTDOWN_GRACE_S = 5.0
SERVER_DEADLINE_MARGIN_S = 2.0


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway owns SIGINT/SIGTERM and stops HTTP
    and gRPC together (uvicorn would otherwise re-raise the signal after its own shutdown)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class RunningGateway:
    """A started gateway. ``http_port`` and ``grpc_port`` are the bound ports (useful with 0)."""

    core: GatewayCore
    http_port: int
    grpc_port: int
    _http: _EmbeddedUvicorn
    _http_task: asyncio.Task
    _grpc: grpc.aio.Server
    _health: Health
    _monitor_task: asyncio.Task
    _pools: tuple[Pool[GrpcTarget], Pool[GrpcDraft]]
    _stopped: bool = False

    async def stop(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """Stops accepting requests, gives those in flight ``grace`` seconds to finish, ends the
        rest with a "shutting down" error, releases their sessions and closes the channels.
        Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._monitor_task.cancel()
        await asyncio.gather(self._monitor_task, return_exceptions=True)
        await self._health.not_serving()
        # The servers' own deadlines come after the drain's, so requests end by interruption
        # (a clean error to the client), not by the servers cancelling their handlers.
        self._http.config.timeout_graceful_shutdown = grace + SERVER_DEADLINE_MARGIN_S
        self._http.should_exit = True
        grpc_stopped = asyncio.ensure_future(self._grpc.stop(grace + SERVER_DEADLINE_MARGIN_S))
        await self.core.drain(grace)
        await asyncio.gather(self._http_task, grpc_stopped, return_exceptions=True)
        await self.core.deps.background.drain()
        for pool in self._pools:
            for member in list(pool.members.values()):
                await member.client.close()


async def start_gateway(
    settings: GatewaySettings,
    tokenizer: Any = None,
    *,
    max_context_len: int | None = None,
    health_interval_s: float = HEALTH_INTERVAL_S,
) -> RunningGateway:
    """Starts HTTP and gRPC in the running loop and returns once both accept connections.

    ``tokenizer`` defaults to the target model's (its fingerprint read where an earlier start saved it);
    ``max_context_len`` to the checkpoint's config, until the target reports its own.
    """
    spec = settings.target_model
    fingerprint = ""
    if tokenizer is None:
        loader = TokenizerLoader(resolve(spec).hf_dir)
        fingerprint = (await asyncio.to_thread(tokenizer_facts, loader)).fingerprint  # saved by an earlier start
        tokenizer = await asyncio.to_thread(loader.get)
    if max_context_len is None:
        max_context_len = await asyncio.to_thread(config_context_len, spec)
    model = ServedModel(settings.served_model_name or default_served_name(spec), tokenizer, max_context_len,
                        fingerprint, _chat_template(settings))
    if model.chat_template is not None:
        _check_chat_template(model)
    defaults = SamplingDefaults()
    if settings.generation_config == "auto":
        defaults = await asyncio.to_thread(SamplingDefaults.of_checkpoint, resolve(spec).hf_dir)
        if defaults.given():
            log.info("sampling defaults from the model's generation_config.json (a request's own fields win; "
                     "--generation-config none: OpenAI's): %s", defaults.given())

    keys = _api_keys(settings)
    security = _security(settings)
    targets, drafts = _pools(settings, security)
    monitor = UpstreamMonitor(targets, drafts, model, settings.resolve_interval_s)
    metrics = make_metrics("gateway")
    for pool in (targets, drafts):
        pool.on_sessions = partial(_observe_sessions, metrics, pool.role)
    deps = GenerationDeps(
        targets=targets,
        drafts=drafts,
        model=model,
        policy=SpeculationPolicy(PolicyConfig.from_settings(settings),
                                 TemperaturePrior(on_update=metrics.record_prior)),
        metrics=metrics,
        draft_ready=lambda: monitor.draft_ready,
        default_num_speculative_tokens=settings.num_speculative_tokens,
        tuning=SessionTuning.from_settings(settings),
        draft_speeds=DraftSpeeds(probe_tokens=settings.draft_probe_tokens),
    )
    for pool in (targets, drafts):  # a draft or target that left takes its measured speeds along
        pool.on_removed = deps.draft_speeds.forget
    core = GatewayCore(
        model,
        deps,
        RequestValidator(model, settings.default_max_tokens, defaults),
        AdmissionControl(settings.max_concurrent_requests, settings.max_concurrent_per_key,
                         settings.rate_limit_per_key),
        monitor,
        keys,
        settings.metrics_auth,
        settings.stream_stall_timeout_s,
    )

    sock = _bind_http_socket(settings.host, settings.http_port)
    try:
        grpc_server, health, grpc_port = build_grpc_server(
            core, settings.host, settings.grpc_port, security.server_credentials(settings.grpc_client_certs))
    except OSError:
        sock.close()
        raise
    await health.not_serving()
    await grpc_server.start()

    config = uvicorn.Config(
        create_app(core),
        host=settings.host,
        port=settings.http_port,
        log_level=settings.log_level.lower(),
        log_config=None,
        lifespan="off",
        ssl_certfile=settings.http_tls_cert,
        ssl_keyfile=settings.http_tls_key,
    )
    http = _EmbeddedUvicorn(config)
    http_port = sock.getsockname()[1]
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    while not http.started:
        if http_task.done():
            await grpc_server.stop(None)
            http_task.result()  # raises what stopped uvicorn
            raise RuntimeError("the HTTP server exited during start-up")
        await asyncio.sleep(0.01)

    async def on_readiness_change(ready: bool) -> None:
        await (health.serving() if ready else health.not_serving())

    monitor.on_readiness_change = on_readiness_change
    await monitor.check()
    monitor_task = asyncio.create_task(monitor.watch(health_interval_s))
    return RunningGateway(core, http_port, grpc_port, http, http_task, grpc_server, health, monitor_task,
                          (targets, drafts))


def _chat_template(settings: GatewaySettings) -> str | None:
    """``--chat-template``'s template (None: the tokenizer's own)."""
    if settings.chat_template is None:
        return None
    try:
        return load_template(settings.chat_template)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"tandem gateway: error: --chat-template: {exc}") from None


def _check_chat_template(model: ServedModel) -> None:
    """Renders a one-message conversation with the template given at start-up, so a broken one stops
    the start rather than failing every chat request."""
    try:
        model.chat.render([ChatMessage("user", "hi")])
    except (ValueError, TypeError) as exc:  # ChatTemplateError is a ValueError
        raise SystemExit(f"tandem gateway: error: --chat-template: {exc}") from None
    log.info("chat requests are rendered with the template --chat-template gave (%d characters)",
             len(model.chat_template or ""))


def _api_keys(settings: GatewaySettings) -> ApiKeys:
    """The keys clients must send; logged by id only (gateway.auth)."""
    try:
        keys = ApiKeys.load(settings.api_keys, settings.api_key_file)
    except OSError as exc:
        raise SystemExit(f"tandem gateway: error: --api-key-file: cannot read {settings.api_key_file}: "
                         f"{exc.strerror}") from None
    if keys.enabled:
        log.info("clients must send one of %d API keys (Authorization: Bearer KEY)%s", len(keys),
                 "; /metrics too" if settings.metrics_auth else "; /metrics and /health are open")
    elif settings.metrics_auth:
        log.warning("--metrics-auth without any API key: /metrics stays open")
    return keys


def _security(settings: GatewaySettings) -> HopSecurity:
    """TLS of the gateway's two ports and of its calls to the pools; it refuses to serve either
    port in plaintext beyond loopback without --insecure (tandem.rpc.security)."""
    for flag, path in (("--http-tls-cert", settings.http_tls_cert), ("--http-tls-key", settings.http_tls_key)):
        if path and not os.access(path, os.R_OK):
            raise SystemExit(f"tandem gateway: error: {flag}: cannot read {path}")
    if bool(settings.http_tls_cert) != bool(settings.http_tls_key):
        raise SystemExit("tandem gateway: error: --http-tls-cert and --http-tls-key go together: give both or neither")
    security = for_service(settings, "gateway", other_ports_tls=bool(settings.http_tls_cert))
    grpc_tls = security.serves_tls
    if settings.http_tls_cert or grpc_tls or security.dials_tls or security.token:
        log.info("gateway ports: HTTP %s, gRPC %s; calls to draft and target: %s%s",
                 "HTTPS" if settings.http_tls_cert else "plaintext",
                 ("mutual TLS" if security.ca and settings.grpc_client_certs else "TLS") if grpc_tls else "plaintext",
                 "TLS" if security.dials_tls else "plaintext", " + internal token" if security.token else "")
    return security


def _pools(settings: GatewaySettings, security: HopSecurity) -> tuple[Pool[GrpcTarget], Pool[GrpcDraft]]:
    """The target and draft pools of ``--target-address`` / ``--draft-address`` (ValueError for a
    malformed list); each draft member has its own circuit breaker."""
    breaker = BreakerConfig.from_settings(settings)
    targets = Pool("target", settings.target_address, partial(GrpcTarget, security=security), close=GrpcTarget.close)
    drafts = Pool("draft", settings.draft_address, partial(GrpcDraft, security=security),
                  breaker=lambda: DraftBreaker(breaker), close=GrpcDraft.close)
    return targets, drafts


def _observe_sessions(metrics: Metrics, role: str, member: Member[Any]) -> None:
    metrics.pool_sessions.labels(role=role, address=member.address).set(member.sessions)


def _bind_http_socket(host: str, port: int) -> socket.socket:
    """Binds here rather than in uvicorn, to learn the port when it is 0 and to raise OSError
    (uvicorn calls sys.exit when it cannot bind).

    The protocol must be named: asyncio sets TCP_NODELAY on accepted connections only when the
    socket says IPPROTO_TCP. Without it, on a kept-alive connection (httpx, the OpenAI SDK) the
    first SSE chunk after the response headers waited for the client's delayed ACK
    (docs/streaming.md#http-socket).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind the HTTP server to {host}:{port}: {exc.strerror}") from exc
    return sock


def run(settings: GatewaySettings) -> None:
    """Serves the gateway until SIGINT or SIGTERM (blocking)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    telemetry.setup_tracing("gateway")
    try:
        asyncio.run(_serve_until_signalled(settings))
    finally:
        telemetry.shutdown_tracing()


async def _serve_until_signalled(settings: GatewaySettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    gateway = await start_gateway(settings)
    # Listening is not serving: until the upstreams are ready, /health answers 503 and says why;
    # the monitor logs "upstreams ready" when they are.
    log.info(
        "gateway for %s %s: OpenAI API at http://%s:%d/v1, gRPC tandem.v1.GatewayService at %s:%d "
        "(target %s, draft %s)",
        gateway.core.model.name, "serving" if gateway.core.monitor.ready else "listening, waiting for its upstreams",
        settings.host, gateway.http_port, settings.host, gateway.grpc_port,
        settings.target_address, settings.draft_address,
    )
    await stop.wait()
    log.info("stopping the gateway; requests in flight get %.0f s to finish (signal again to end them now)",
             SHUTDOWN_GRACE_S)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, gateway.core.hurry)
    await gateway.stop()
