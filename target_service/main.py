"""Running the target service: ``run(settings)`` for ``tandem target``, ``start_target`` in-process.

The gRPC server starts first, with health NOT_SERVING and TargetService answering UNAVAILABLE, so
orchestrators can probe it while the model loads; it turns SERVING once the model is loaded and
has run one warm-up pass.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from tandem import telemetry
from tandem.config import TargetSettings
from tandem.rpc.endpoints import Health, bind, enable_reflection, make_server
from tandem.rpc.security import PLAINTEXT, HopSecurity, for_service
from tandem.telemetry.metrics import Metrics, make_metrics, serve_metrics
from tandem.models.worker import ModelWorker
from tandem.v1 import target_pb2_grpc
from target_service.engine import TargetEngine
from target_service.server import SERVICE_NAME, TargetServicer

log = logging.getLogger(__name__)

T = TypeVar("T")

# The calls of a request (not Info, health or reflection) get a span continuing the caller's trace.
TRACED_METHODS = [telemetry.full_method(SERVICE_NAME, m) for m in ("Prefill", "Verify", "Generate", "Release")]


@dataclass
class RunningTarget:
    """A started target gRPC server (``port`` is the bound port, useful with port 0)."""

    server: grpc.aio.Server
    servicer: TargetServicer
    health: Health
    worker: ModelWorker
    port: int
    _reaper: asyncio.Task | None = field(default=None, repr=False)

    async def attach(self, engine: TargetEngine) -> None:
        """Serves ``engine`` from now on: TargetService answers, health turns SERVING."""
        self.servicer.attach(engine)
        self._reaper = asyncio.create_task(_expire_idle_sessions(engine, self.worker))
        await self.health.serving()

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stops accepting calls, lets running ones end for ``grace_s``, frees the worker."""
        await self.health.not_serving()
        if self._reaper is not None:
            self._reaper.cancel()
        await self.server.stop(grace_s)
        self.worker.shutdown(wait=False)


async def start_target(
    engine: TargetEngine | None, host: str = "127.0.0.1", port: int = 0, security: HopSecurity = PLAINTEXT
) -> RunningTarget:
    """Starts TargetService (plus health and reflection) on ``host:port`` in the running loop,
    with the TLS and internal token of ``security``.

    With an engine (already loaded) it serves at once; with None it answers NOT_SERVING /
    UNAVAILABLE until ``attach``.
    """
    server = make_server([*security.interceptors(SERVICE_NAME), *telemetry.server_interceptors(TRACED_METHODS)])
    worker = ModelWorker("target-model")
    servicer = TargetServicer(worker)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    health = Health(server, [SERVICE_NAME])
    enable_reflection(server, [SERVICE_NAME])
    bound = bind(server, host, port, security.server_credentials())
    await health.not_serving()
    await server.start()
    running = RunningTarget(server, servicer, health, worker, bound)
    if engine is not None:
        await running.attach(engine)
    return running


def run(settings: TargetSettings) -> None:
    """``tandem target``: serves until SIGINT or SIGTERM (blocking)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    telemetry.setup_tracing("target")
    try:
        asyncio.run(serve(settings))
    finally:
        telemetry.shutdown_tracing()


async def serve(settings: TargetSettings) -> None:
    """Loads the model while already answering health checks, then serves until a stop signal."""
    security = for_service(settings, "target")
    metrics = make_metrics("target")
    serve_metrics(metrics, settings.host, settings.metrics_port)
    running = await start_target(None, settings.host, settings.port, security)
    log.info("target gRPC on %s:%d, %s (loading %s)", settings.host, running.port, security.describe(),
             settings.target_model)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        loading = _in_daemon_thread(_load_and_warm_up, settings, metrics)
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            engine = loading.result()  # a failed load raises here and stops the service
            await running.attach(engine)
            log.info("target serving %s on %s:%d", engine.info.model_name, settings.host, running.port)
            await stopping
        log.info("target stopping")
    finally:
        stopping.cancel()
        await running.stop()


def _load_and_warm_up(settings: TargetSettings, metrics: Metrics) -> TargetEngine:
    engine = TargetEngine.from_settings(settings, metrics)
    engine.warmup()
    return engine


def _in_daemon_thread(fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
    """Runs ``fn`` on a daemon thread, so a stop signal during a long model load exits at once."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(setter: Callable[[object], None], value: object) -> None:
        if not future.done():
            setter(value)

    def target() -> None:
        try:
            outcome = (future.set_result, fn(*args))
        except BaseException as error:  # noqa: BLE001 - handed to the loop, which re-raises it
            outcome = (future.set_exception, error)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: the service stopped before the load ended
            pass

    threading.Thread(target=target, name="target-load", daemon=True).start()
    return future


async def _expire_idle_sessions(engine: TargetEngine, worker: ModelWorker) -> None:
    """Drops idle sessions every quarter TTL (on the worker, like every engine call)."""
    interval_s = min(max(engine.store.ttl_s / 4, 0.05), 30.0)
    while True:
        await asyncio.sleep(interval_s)
        try:
            await worker.run(engine.expire_idle)
        except Exception:  # never let a reaper failure stop the service
            log.exception("expiring idle sessions failed")
