"""``tandem serve``: target, draft and gateway as three child processes talking gRPC on loopback.

The supervisor prepares the models once (a GGUF is converted before any child starts, so the
children do not race to convert it), starts the children, waits until every one reports SERVING
over gRPC health and prints the URLs. From then on a child that exits is started again with its
own command line after a delay that doubles with each restart (:class:`Backoff`, reset once the
child has stayed up a while), while the others keep serving: the gateway answers 503 for what
needs the missing service and resumes when it is back. Each restart is logged, and the restarted
service reports how many there were in ``tandem_process_restarts``. A child that dies before the
stack is ready stops it (a port in use or a bad model would only fail again). Ctrl-C / SIGTERM stop
every child in order: gateway, draft, target.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem import models
from tandem.config import ServeSettings
from tandem.telemetry.metrics import RESTARTS_ENV

log = logging.getLogger(__name__)


@dataclass
class Backoff:
    """The delays before restarting one child: ``initial_s``, doubling up to ``max_s``; back to
    ``initial_s`` once the child had stayed up ``stable_s`` (a crash a day is not a crash loop)."""

    initial_s: float = 1.0
    max_s: float = 60.0
    stable_s: float = 120.0
    _next_s: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._next_s = self.initial_s

    def delay(self, uptime_s: float) -> float:
        """The delay before the restart of a child that exited after ``uptime_s`` seconds up."""
        if uptime_s >= self.stable_s:
            self._next_s = self.initial_s
        delay, self._next_s = self._next_s, min(self.max_s, self._next_s * 2)
        return delay


@dataclass
class Child:
    name: str
    argv: list[str]
    health_address: str
    process: subprocess.Popen | None = field(default=None, repr=False)
    restarts: int = 0
    started_at: float = 0.0  # time.monotonic() of the last start
    restart_at: float | None = None  # when a child that exited is due to start again
    backoff: Backoff = field(default_factory=Backoff, repr=False)

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def spawn(self) -> None:
        """Starts the child's command (again), telling it how often it was restarted."""
        env = {**os.environ, RESTARTS_ENV: str(self.restarts)}
        self.process = subprocess.Popen(self.argv, start_new_session=True, env=env)
        self.started_at, self.restart_at = time.monotonic(), None


def connect_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def child_commands(s: ServeSettings) -> list[Child]:
    """The three services with flags derived from the serve settings (start order: target first)."""
    py = [sys.executable, "-m", "tandem.cli"]
    near = connect_host(s.host)
    common = ["--host", s.host, "--log-level", s.log_level]
    device = ["--device", s.device, "--dtype", s.dtype]
    served = ["--served-model-name", s.served_model_name] if s.served_model_name else []
    target = Child(
        "target",
        [*py, "target", *common, *device, *served, "--target-model", s.target_model,
         "--port", str(s.target_port), "--metrics-port", str(s.target_metrics_port)],
        f"{near}:{s.target_port}",
    )
    draft = Child(
        "draft",
        [*py, "draft", *common, *device, "--draft-model", models.resolve_draft_spec(s.draft_model, s.target_model),
         "--target-model", s.target_model,
         "--target-address", f"{near}:{s.target_port}", "--port", str(s.draft_port),
         "--metrics-port", str(s.draft_metrics_port), "--num-speculative-tokens", str(s.num_speculative_tokens)],
        f"{near}:{s.draft_port}",
    )
    gateway = Child(
        "gateway",
        [*py, "gateway", *common, *served, "--target-model", s.target_model,
         "--target-address", f"{near}:{s.target_port}", "--draft-address", f"{near}:{s.draft_port}",
         "--http-port", str(s.http_port), "--grpc-port", str(s.grpc_port),
         "--num-speculative-tokens", str(s.num_speculative_tokens), "--stream-smoothing", s.stream_smoothing],
        f"{near}:{s.grpc_port}",
    )
    return [target, draft, gateway]


def is_serving(address: str, timeout: float = 2.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class Supervisor:
    def __init__(self, settings: ServeSettings, children: list[Child] | None = None) -> None:
        self.settings = settings
        self.children = child_commands(settings) if children is None else children
        self._stopping = False

    def prepare_models(self) -> None:
        for role, spec in (("target", self.settings.target_model), ("draft", self.settings.draft_model)):
            if models.is_model_free_draft(spec):
                continue  # no model of its own (an eagle head reads the target's, prepared above)
            started = time.monotonic()
            log.info("preparing %s model %s (the first start converts a GGUF once)", role, spec)
            resolved = models.resolve(spec)
            log.info("%s model ready in %s (%.1fs)", role, resolved.hf_dir, time.monotonic() - started)

    def start(self) -> None:
        for child in self.children:
            log.info("starting %s: %s", child.name, " ".join(child.argv[1:]))
            child.spawn()

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.exited() is not None), None)

    def wait_ready(self) -> bool:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        pending = list(self.children)
        while pending and not self._stopping:
            dead = self.dead_child()
            if dead is not None:
                log.error("%s exited with code %s before it was ready", dead.name, dead.exited())
                return False
            if time.monotonic() > deadline:
                log.error("not ready after %.0fs: %s", self.settings.ready_timeout_s, [c.name for c in pending])
                return False
            pending = [c for c in pending if not is_serving(c.health_address)]
            if pending:
                time.sleep(0.5)
        return True

    def print_urls(self) -> None:
        s = self.settings
        near = connect_host(s.host)
        print(
            "\ntandem is ready\n"
            f"  OpenAI API    http://{near}:{s.http_port}/v1   (model: "
            f"{s.served_model_name or models.default_served_name(s.target_model)})\n"
            f"  gateway gRPC  {near}:{s.grpc_port}   (tandem.v1.GatewayService)\n"
            f"  draft gRPC    {near}:{s.draft_port}   "
            f"({models.resolve_draft_spec(s.draft_model, s.target_model)}, K={s.num_speculative_tokens})\n"
            f"  target gRPC   {near}:{s.target_port}\n"
            f"  metrics       http://{near}:{s.http_port}/metrics  http://{near}:{s.draft_metrics_port}/metrics"
            f"  http://{near}:{s.target_metrics_port}/metrics\n"
            "Press Ctrl-C to stop.\n",
            flush=True,
        )

    def watch(self, poll_s: float = 0.2) -> int:
        """Restarts children that exit, each after its backoff, until a stop is requested."""
        while not self._stopping:
            self.restart_exited(time.monotonic())
            time.sleep(poll_s)
        return 0

    def restart_exited(self, now: float) -> None:
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restarts += 1
                    log.warning("restarting %s (restart %d)", child.name, child.restarts)
                    child.spawn()
            elif child.exited() is not None:
                delay = child.backoff.delay(now - child.started_at)
                child.restart_at = now + delay
                log.error("%s exited with code %s after %.0fs up; restarting it in %.1fs", child.name,
                          child.exited(), now - child.started_at, delay)

    def request_stop(self, *_: object) -> None:
        self._stopping = True

    def stop(self, grace_s: float = 15.0) -> None:
        """Gateway first (no new requests), then draft, then target."""
        for child in reversed(self.children):
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
                try:
                    child.process.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0fs; killing it", child.name, grace_s)
                    child.process.kill()
                    child.process.wait()


def serve(settings: ServeSettings) -> int:
    supervisor = Supervisor(settings)
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    try:
        supervisor.prepare_models()
        supervisor.start()
        if not supervisor.wait_ready():
            return 1
        if supervisor._stopping:
            return 0
        supervisor.print_urls()
        return supervisor.watch()
    finally:
        supervisor.stop()
        log.info("stopped")
