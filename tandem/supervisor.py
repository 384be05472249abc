"""``tandem serve``: target, draft and gateway as three child processes talking gRPC on loopback.

The supervisor prepares the models once (a GGUF is converted before any child starts, so the
children do not race to convert it), starts the children, waits until every one reports SERVING
over gRPC health, prints the URLs, and stops all of them when one dies or on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem import models
from tandem.config import ServeSettings

log = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    argv: list[str]
    health_address: str
    process: subprocess.Popen | None = field(default=None, repr=False)

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()


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
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.children = child_commands(settings)
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
            child.process = subprocess.Popen(child.argv, start_new_session=True)

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

    def watch(self) -> int:
        while not self._stopping:
            dead = self.dead_child()
            if dead is not None:
                log.error("%s exited with code %s; stopping the stack", dead.name, dead.exited())
                return 1
            time.sleep(0.5)
        return 0

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
