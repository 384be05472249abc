"""A stack of its own: ``tandem serve`` as a child process on free loopback ports.

Used when no ``--url`` is given and nothing answers on the default gateway port, so one command
measures a model pair from scratch; it is stopped (SIGINT, like Ctrl-C) before the peer runs.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandem.fleet import free_ports as fleet_free_ports

READY_LINE = "tandem is ready"
PORT_FLAGS = ("http-port", "grpc-port", "draft-port", "target-port", "draft-metrics-port", "target-metrics-port")


class StackError(RuntimeError):
    """The child stack exited or did not become ready; carries the tail of its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (``free_port`` called twice may return one port twice)."""
    return fleet_free_ports("127.0.0.1", count, set())


@dataclass
class OwnStack:
    target_model: str
    draft_model: str
    num_speculative_tokens: int
    device: str = "auto"
    dtype: str = "auto"
    extra_args: tuple[str, ...] = ()
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http-port']}"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "tandem.cli", "serve", "--target-model", self.target_model,
                "--draft-model", self.draft_model, "--num-speculative-tokens", str(self.num_speculative_tokens),
                "--device", self.device, "--dtype", self.dtype, "--log-level", "warning", *self.extra_args]
        for flag, port in self.ports.items():
            argv += [f"--{flag}", str(port)]
        return argv

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])

    def start(self, ready_timeout_s: float = 900.0) -> None:
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        handle, name = tempfile.mkstemp(prefix="tandem-bench-stack-", suffix=".log")
        self.log_path = Path(name)
        with open(handle, "w") as log:
            self.process = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + ready_timeout_s
        while READY_LINE not in self.log_path.read_text(errors="replace"):
            problem = None
            if self.process.poll() is not None:
                problem = f"tandem serve exited with {self.process.returncode}"
            elif time.monotonic() > deadline:
                problem = f"tandem serve was not ready after {ready_timeout_s:.0f}s"
            if problem is not None:
                tail = self.log_tail()
                self.stop()
                raise StackError(f"{problem}:\n{tail}")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
