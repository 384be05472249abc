"""``tandem serve``: target, draft and gateway as child processes talking gRPC on loopback.

``--targets N --drafts M`` (default 1 and 1) runs N targets and M drafts besides the one gateway;
their names, ports (target i on ``--target-port`` + 2*i, draft j on ``--draft-port`` + 2*j, the
metrics ports alike) and command lines are :mod:`tandem.fleet`'s. Every draft and the gateway are
told every target's address, the gateway every draft's.

The supervisor prepares the models once for the whole fleet (a GGUF is converted before any child
starts, so the children do not race to convert it), starts the children, waits until every one
reports SERVING over gRPC health and prints the URLs (:func:`tandem.fleet.ready_block`). From then on a child that exits is started again with its
own command line after a delay that doubles with each restart (:class:`Backoff`, reset once the
child has stayed up a while), while the others keep serving: the gateway answers 503 for what
needs the missing service and resumes when it is back. Each restart is logged, and the restarted
service reports how many there were in ``tandem_process_restarts``. A child that dies before the
stack is ready stops it (a port in use or a bad model would only fail again). Ctrl-C / SIGTERM stop
every child in order: gateway, then the drafts, then the targets (each role's children together).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem import fleet, models
from tandem.cli import LOG_NAME_ENV
from tandem.config import ServeSettings
from tandem.fleet import Fleet, FleetError, connect_host  # noqa: F401 (connect_host: re-exported)
from tandem.rpc.security import PLAINTEXT, HopSecurity, for_service
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
    # Settings passed in the environment rather than the command line, which any local user can
    # read (`ps`): the gateway's API keys, the internal token.
    env: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def role(self) -> str:
        """``target-1`` -> ``target``: the children stopped together."""
        return re.sub(r"-\d+$", "", self.name)

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def spawn(self) -> None:
        """Starts the child's command (again), telling it how often it was restarted."""
        env = {**os.environ, **self.env, RESTARTS_ENV: str(self.restarts)}
        self.process = subprocess.Popen(self.argv, start_new_session=True, env=env)
        self.started_at, self.restart_at = time.monotonic(), None


def child_commands(s: ServeSettings, planned: Fleet | None = None) -> list[Child]:
    """The children with flags derived from the serve settings, in start order: targets, drafts,
    gateway (names, ports and command lines: :mod:`tandem.fleet`)."""
    planned = fleet.plan(s) if planned is None else planned
    secret = {"TANDEM_API_KEYS": s.api_keys} if s.api_keys else {}
    token = {"TANDEM_INTERNAL_TOKEN": s.internal_token} if s.internal_token else {}
    return [Child(name, argv, health, env={LOG_NAME_ENV: name, **token, **(secret if name == "gateway" else {})})
            for name, argv, health in fleet.commands(s, planned)]


def is_serving(address: str, timeout: float = 2.0, security: HopSecurity = PLAINTEXT) -> bool:
    with security.sync_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class Supervisor:
    def __init__(self, settings: ServeSettings, children: list[Child] | None = None) -> None:
        """Plans the fleet's ports first: raises :class:`FleetError` for a fleet that cannot start."""
        self.settings = settings
        self.security = for_service(settings, "serve", other_ports_tls=bool(settings.http_tls_cert),
                                    what="tandem serve's services")
        self.fleet = fleet.plan(settings)
        self.children = child_commands(settings, self.fleet) if children is None else children
        self._stopping = False

    def prepare_models(self) -> None:
        prebuild = self._prebuild_kernels()
        for role, spec in (("target", self.settings.target_model), ("draft", self.settings.draft_model)):
            if models.is_model_free_draft(spec):
                continue  # no model of its own (an eagle head reads the target's, prepared above)
            started = time.monotonic()
            log.info("preparing %s model %s (the first start converts a GGUF once)", role, spec)
            try:
                resolved = models.resolve(spec)
            except models.ModelSpecError as error:
                drafts = (f"; or a draft: {', '.join(models.DRAFT_NAMES)}, an eagle head directory"
                          if role == "draft" else "")
                raise models.ModelSpecError(f"--{role}-model: {error}{drafts}") from None
            log.info("%s model ready in %s (%.1fs)", role, resolved.hf_dir, time.monotonic() - started)
        if prebuild is not None:
            prebuild.wait()

    def _prebuild_kernels(self) -> subprocess.Popen | None:
        """On a first start (the target's GGUF not converted yet) of a target that computes on its
        GGUF blocks on CPU, compiles the CPU kernels in a process of its own while the conversion
        runs, instead of in the target after it (``tandem.quant.native.prebuild``)."""
        settings = self.settings
        on_gguf_blocks = not settings.device.startswith("cuda") and settings.dtype == "auto"
        if not on_gguf_blocks or not models.needs_conversion(settings.target_model):
            return None
        log.info("building the CPU kernels beside the conversion (first start only)")
        return subprocess.Popen([sys.executable, "-c", "from tandem.quant.native import prebuild; prebuild()"],
                                stdin=subprocess.DEVNULL)

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
            pending = [c for c in pending if not is_serving(c.health_address, security=self.security)]
            if pending:
                time.sleep(0.5)
        return True

    def print_urls(self) -> None:
        print(fleet.ready_block(self.settings, self.fleet), flush=True)

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
        """Gateway first (no new requests), then the drafts, then the targets: each role's children
        are signalled together and given ``grace_s`` together before the next role's."""
        for _, group in itertools.groupby(reversed(self.children), key=lambda c: c.role):
            running = [c for c in group if c.process is not None and c.process.poll() is None]
            for child in running:
                child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for child in running:
                try:
                    child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0fs; killing it", child.name, grace_s)
                    child.process.kill()
                    child.process.wait()


def serve(settings: ServeSettings) -> int:
    try:
        supervisor = Supervisor(settings)
        fleet.check_ports_free(supervisor.fleet, settings.host)
    except FleetError as refused:
        log.error("tandem serve: %s", refused)
        print(f"tandem serve: {refused}", file=sys.stderr, flush=True)
        return 2
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    try:
        try:
            supervisor.prepare_models()
        except models.ModelSpecError as refused:
            log.error("tandem serve: %s", refused)
            print(f"tandem serve: {refused}", file=sys.stderr, flush=True)
            return 2
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
