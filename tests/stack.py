"""Starts ``tandem serve`` as a real process tree for whole-stack tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    http_port: int
    grpc_port: int
    draft_port: int
    target_port: int
    draft_metrics_port: int
    target_metrics_port: int
    process: subprocess.Popen
    output: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def metrics(self, port: int | None = None) -> str:
        url = f"http://127.0.0.1:{port}/metrics" if port else f"{self.base_url}/metrics"
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


@contextmanager
def running_stack(
    target_model: str,
    draft_model: str = "ngram",
    k: int = 4,
    default_ports: bool = False,
    ready_timeout_s: float = 300.0,
    extra_args: tuple[str, ...] = (),
) -> Iterator[Stack]:
    if default_ports:
        ports = dict(http_port=8000, grpc_port=50051, draft_port=50052, target_port=50053,
                     draft_metrics_port=9052, target_metrics_port=9053)
    else:
        ports = dict(http_port=free_port(), grpc_port=free_port(), draft_port=free_port(), target_port=free_port(),
                     draft_metrics_port=free_port(), target_metrics_port=free_port())
    argv = [sys.executable, "-m", "tandem.cli", "serve", "--target-model", target_model, "--draft-model", draft_model,
            "--num-speculative-tokens", str(k), *extra_args]
    for name, port in ports.items():
        argv += ["--" + name.replace("_", "-"), str(port)]
    env = {k_: v for k_, v in os.environ.items() if not k_.startswith("TANDEM_") or k_ == "TANDEM_CACHE_DIR"}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    stack = Stack(process=process, **ports)
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            stack.output.append(line)
            if "tandem is ready" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + ready_timeout_s
    try:
        while not ready.is_set():
            if process.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {process.returncode}:\n{stack.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tandem serve not ready in {ready_timeout_s}s:\n{stack.log()}")
            time.sleep(0.2)
        yield stack
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
