"""Starts ``tandem serve`` as a real process tree for whole-stack tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from tandem.tools.bench.stack import free_port, free_ports
from tandem.config import ServeSettings
from tandem.supervisor import Child, child_commands, is_serving


@dataclass
class Stack:
    http_port: int
    grpc_port: int
    draft_port: int
    target_port: int
    draft_metrics_port: int
    target_metrics_port: int
    process: subprocess.Popen
    host: str = "127.0.0.1"
    output: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def metrics(self, port: int | None = None) -> str:
        url = f"http://{self.host}:{port}/metrics" if port else f"{self.base_url}/metrics"
        return httpx.get(url, timeout=10).text

    def log(self) -> str:
        return "".join(self.output[-200:])


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total


DEFAULT_PORTS_HOST = "127.0.0.2"  # all of 127.0.0.0/8 is loopback on Linux


@contextmanager
def running_stack(
    target_model: str,
    draft_model: str = "ngram",
    k: int = 4,
    default_ports: bool = False,
    ready_timeout_s: float = 300.0,
    extra_args: tuple[str, ...] = (),
) -> Iterator[Stack]:
    """``default_ports``: the design's default ports (what the outside contract checker reads), on
    ``DEFAULT_PORTS_HOST``, a loopback address of their own, so a ``tandem serve`` on 127.0.0.1 (the
    default bind) and this stack do not clash."""
    host = "127.0.0.1"
    if default_ports:
        host = DEFAULT_PORTS_HOST
        ports = dict(http_port=8000, grpc_port=50051, draft_port=50052, target_port=50053,
                     draft_metrics_port=9052, target_metrics_port=9053)
    else:
        names = ("http_port", "grpc_port", "draft_port", "target_port", "draft_metrics_port", "target_metrics_port")
        ports = dict(zip(names, free_ports(len(names))))
    argv = [sys.executable, "-m", "tandem.cli", "serve", "--target-model", target_model, "--draft-model", draft_model,
            "--num-speculative-tokens", str(k), "--host", host, *extra_args]
    for name, port in ports.items():
        argv += ["--" + name.replace("_", "-"), str(port)]
    output: list[str] = []
    with serving(argv, {}, output, ready_timeout_s) as process:
        yield Stack(process=process, host=host, output=output, **ports)


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without its tandem settings (the cache stays), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") or k == "TANDEM_CACHE_DIR"}
    return {**env, **extra}


@contextmanager
def serving(argv: list[str], env: dict[str, str], output: list[str], ready_timeout_s: float) -> Iterator[subprocess.Popen]:
    """Runs ``tandem serve`` (``argv``) until its ready block is printed whole, collecting its
    output in ``output``; stops it (SIGINT, then SIGKILL to its process group) on the way out."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=_clean_env(env), start_new_session=True)
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            if "Press Ctrl-C to stop." in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + ready_timeout_s
    try:
        while not ready.is_set():
            log = "".join(output[-200:])
            if process.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {process.returncode}:\n{log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tandem serve not ready in {ready_timeout_s}s:\n{log}")
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# ---- the three services as separate processes, so a test can kill and restart one -------------


@dataclass
class Services:
    """Target, draft and gateway started from ``tandem serve``'s own child commands, without its
    supervisor (which would restart a child that a test kills)."""

    settings: ServeSettings
    children: dict[str, Child]
    env: dict[str, str]
    log_dir: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.settings.grpc_port}"

    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=10).text

    def start(self, name: str) -> None:
        """Starts (or restarts) one service with exactly its original command line."""
        child = self.children[name]
        out = open(os.path.join(self.log_dir, f"{name}.log"), "a")
        child.process = subprocess.Popen(child.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        out.close()

    def kill(self, name: str) -> None:
        """SIGKILL: the service gets no chance to end its calls cleanly."""
        process = self.children[name].process
        process.kill()
        process.wait()

    def wait_serving(self, name: str, timeout_s: float = 120.0) -> None:
        child = self.children[name]
        deadline = time.monotonic() + timeout_s
        while not is_serving(child.health_address, timeout=1.0):
            if child.exited() is not None:
                raise RuntimeError(f"{name} exited with {child.exited()}:\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not serving in {timeout_s}s:\n{self.log(name)}")
            time.sleep(0.2)

    def log(self, name: str) -> str:
        path = os.path.join(self.log_dir, f"{name}.log")
        with open(path, errors="replace") as handle:
            return "".join(handle.readlines()[-200:])

    def stop(self) -> None:
        for child in reversed(list(self.children.values())):
            process = child.process
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


@contextmanager
def running_services(
    target_model: str, draft_model: str, log_dir: str, k: int = 4, gateway_env: dict[str, str] | None = None
) -> Iterator[Services]:
    """The three services on free ports; ``gateway_env`` adds ``TANDEM_*`` settings (all services
    see them, only the gateway reads the gateway's)."""
    http, grpc, draft, target, draft_metrics, target_metrics = free_ports(6)
    settings = ServeSettings(
        target_model=target_model, draft_model=draft_model, num_speculative_tokens=k,
        http_port=http, grpc_port=grpc, draft_port=draft, target_port=target,
        draft_metrics_port=draft_metrics, target_metrics_port=target_metrics, log_level="info",
    )
    env = {k_: v for k_, v in os.environ.items() if not k_.startswith("TANDEM_") or k_ == "TANDEM_CACHE_DIR"}
    env.update(gateway_env or {})
    services = Services(settings, {c.name: c for c in child_commands(settings)}, env, log_dir)
    try:
        for name in services.children:
            services.start(name)
        for name in services.children:
            services.wait_serving(name)
        yield services
    finally:
        services.stop()


# ---- a local fleet: tandem serve --targets N --drafts M, every port chosen by the supervisor -----


@dataclass
class Fleet:
    process: subprocess.Popen
    addresses: dict[str, str]  # "gateway", "target-0", ..., "draft-0", ..., and "http"
    output: list[str] = field(default_factory=list)

    @property
    def grpc_address(self) -> str:
        return self.addresses["gateway"]

    @property
    def base_url(self) -> str:
        return f"http://{self.addresses['http']}"

    def names(self, role: str) -> list[str]:
        return sorted(name for name in self.addresses if name.startswith(role + "-"))

    def pid(self, name: str) -> int | None:
        """The process id of the child ``name`` now (None while it is down)."""
        import psutil

        port = self.addresses[name].rsplit(":", 1)[1]
        for child in psutil.Process(self.process.pid).children():
            try:
                argv = child.cmdline()
            except psutil.Error:
                continue
            if child.status() != psutil.STATUS_ZOMBIE and "--port" in argv and argv[argv.index("--port") + 1] == port:
                return child.pid
        return None

    def log(self) -> str:
        return "".join(self.output[-300:])


@contextmanager
def running_fleet(target_model: str, draft_model: str, targets: int, drafts: int, k: int = 4,
                  env: dict[str, str] | None = None, ready_timeout_s: float = 300.0) -> Iterator[Fleet]:
    """``tandem serve --targets N --drafts M`` with every gRPC and HTTP port 0 (the supervisor picks
    free ones and prints them) and metrics off; ``env``: extra settings for the children."""
    from tandem.fleet import read_ready_block

    argv = [sys.executable, "-m", "tandem.cli", "serve", "--target-model", target_model, "--draft-model", draft_model,
            "--num-speculative-tokens", str(k), "--targets", str(targets), "--drafts", str(drafts),
            "--http-port", "0", "--grpc-port", "0", "--target-port", "0", "--draft-port", "0",
            "--target-metrics-port", "0", "--draft-metrics-port", "0"]
    output: list[str] = []
    with serving(argv, env or {}, output, ready_timeout_s) as process:
        yield Fleet(process, read_ready_block("".join(output)), output)
