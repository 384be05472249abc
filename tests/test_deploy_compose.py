"""compose.yaml, checked without a Docker engine.

* It validates against the Compose specification's JSON schema (``../shared/schemas``).
* Its target, draft and gateway services are started here as compose would start them: their
  ``command`` with their ``environment`` (variables interpolated), service names translated to
  127.0.0.1 and every container port to a free local port, tiny models instead of the default.
  Their healthchecks (the gRPC health protocol) are run, a request goes through the gateway, and
  the spans reach an OTLP endpoint standing in for Jaeger under the services' compose names.
* A real Prometheus, configured by ``deploy/prometheus/prometheus.yml`` (targets translated the
  same way) with the alert rules loaded, scrapes that stack; the acceptance rate is read back
  through its HTTP API, and every Grafana panel query is evaluated by it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import jsonschema
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from stack import free_port, metric_value
from test_telemetry_otlp import OtlpReceiver

from tandem.config import DEFAULT_DRAFT, DEFAULT_K

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "compose.yaml"
SCHEMA = REPO.parent / "shared" / "schemas" / "compose-spec.json"
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "tandem.json"
TANDEM_SERVICES = ("target", "draft", "gateway")  # start order
TLS_OVERRIDE = REPO / "deploy" / "compose.tls.yaml"
TLS_MOUNT = "/etc/tandem/tls"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_validates_against_the_compose_specification(compose) -> None:
    assert SCHEMA.is_file(), f"the Compose JSON schema is expected beside the checkout at {SCHEMA}"
    jsonschema.validate(compose, json.loads(SCHEMA.read_text()))


def test_compose_layout(compose) -> None:
    services = compose["services"]
    assert {"target", "draft", "gateway", "jaeger", "prometheus", "grafana"} <= set(services)
    for name in ("target", "target-gpu", "draft", "gateway"):
        service = services[name]
        assert "build" in service and "models:/cache" in service["volumes"], name
        assert service["environment"]["TANDEM_HOST"] == "0.0.0.0"
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert service["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "tandem.rpc.healthcheck"], name
    # CPU by default, the GPU target behind a profile, reachable under the same name.
    assert services["target"]["profiles"] == ["cpu"] and services["target-gpu"]["profiles"] == ["gpu"]
    assert "COMPOSE_PROFILES=cpu" in (REPO / ".env").read_text().splitlines()
    assert services["target-gpu"]["networks"]["default"]["aliases"] == ["target"]
    devices = services["target-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    # Internal ports stay internal: only the gateway and the UIs are published.
    published = {name: s.get("ports", []) for name, s in services.items() if s.get("ports")}
    assert published == {"gateway": ["8000:8000", "50051:50051"], "jaeger": ["16686:16686"],
                         "prometheus": ["9090:9090"], "grafana": ["3000:3000"]}
    assert set(compose["volumes"]) >= {"models"}
    # The draft knows the target's SPEC (the eagle draft reads the target's embedding and LM head),
    # and its default draft is tandem's.
    draft_env = services["draft"]["environment"]
    assert draft_env["TANDEM_TARGET_MODEL"] == services["target"]["environment"]["TANDEM_TARGET_MODEL"]
    assert draft_env["TANDEM_DRAFT_MODEL"] == f"${{TANDEM_DRAFT_MODEL:-{DEFAULT_DRAFT}}}"
    # Pools: target and draft scale by replicas; gateway and drafts find every replica by DNS name.
    for name, variable in (("target", "TANDEM_TARGETS"), ("target-gpu", "TANDEM_TARGETS"), ("draft", "TANDEM_DRAFTS")):
        assert services[name]["deploy"]["replicas"] == f"${{{variable}:-1}}", name
    assert services["gateway"]["environment"]["TANDEM_TARGET_ADDRESS"] == "target:50053"
    assert services["gateway"]["environment"]["TANDEM_DRAFT_ADDRESS"] == "draft:50052"
    assert draft_env["TANDEM_TARGET_ADDRESS"] == "target:50053"
    # K defaults to tandem's own default in every service that takes it.
    for name in ("draft", "gateway"):
        k = services[name]["environment"]["TANDEM_NUM_SPECULATIVE_TOKENS"]
        assert k == f"${{TANDEM_NUM_SPECULATIVE_TOKENS:-{DEFAULT_K}}}", (name, k)


def test_plain_compose_is_allowed_plaintext_inside_its_network_and_tls_overrides_it(compose) -> None:
    """The services bind 0.0.0.0, which tandem refuses in plaintext without --insecure: compose
    says so by default, and deploy/compose.tls.yaml turns TLS on instead."""
    from tandem.config import DraftSettings, GatewaySettings, TargetSettings
    from tandem.rpc.security import for_service

    classes = {"target": TargetSettings, "draft": DraftSettings, "gateway": GatewaySettings}
    for name, settings_cls in classes.items():
        env = {k: interpolate(str(v), {}) for k, v in compose["services"][name]["environment"].items()}
        settings = settings_cls(**{k.removeprefix("TANDEM_").lower(): v for k, v in env.items()
                                   if k.startswith("TANDEM_") and k != "TANDEM_CACHE_DIR"})
        assert settings.host == "0.0.0.0" and settings.insecure, name
        for_service(settings, name)  # starts (no SystemExit)
    override = yaml.safe_load(TLS_OVERRIDE.read_text())
    jsonschema.validate(override, json.loads(SCHEMA.read_text()))
    for name in ("target", "target-gpu", "draft", "gateway"):
        env = override["services"][name]["environment"]
        assert env["TANDEM_INSECURE"] == "false" and env["TANDEM_TLS_CA"].startswith(TLS_MOUNT), name
        assert override["services"][name]["volumes"] == [f"${{TANDEM_TLS_DIR:-./deploy/tls}}:{TLS_MOUNT}:ro"]
    assert override["services"]["gateway"]["environment"]["TANDEM_HTTP_TLS_CERT"].startswith(TLS_MOUNT)


def with_override(compose: dict, override: dict) -> dict:
    """Compose's merge of an override file, for the parts these files use: environments merge."""
    merged = json.loads(json.dumps(compose))
    for name, service in override["services"].items():
        merged["services"][name]["environment"].update(service.get("environment", {}))
    return merged


# -- running the services as compose would -----------------------------------------------------


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(value: str, variables: dict[str, str]) -> str:
    """Compose's ``${VAR}`` / ``${VAR:-default}`` substitution."""
    return _VARIABLE.sub(lambda m: variables.get(m.group(1)) or (m.group(2) or ""), value)


@dataclass
class LocalCompose:
    """The compose services as local processes, with compose's ports mapped to free local ones."""

    compose: dict
    variables: dict[str, str]
    otlp_port: int
    tls_dir: Path | None = None  # where deploy/compose.tls.yaml's volume comes from
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def port(self, service: str, container_port: int) -> int:
        key = (service, container_port)
        while key not in self.ports:
            port = free_port()  # the OS may hand out a just-released port again
            if port not in self.ports.values():
                self.ports[key] = port
        return self.ports[key]

    def translate(self, service: str, value: str) -> str:
        """A value as seen from this machine: ``name:port`` and the service's own ports mapped,
        the TLS volume's files in ``tls_dir``."""
        value = interpolate(str(value), self.variables)
        if value.startswith(TLS_MOUNT) and self.tls_dir is not None:
            return str(self.tls_dir / value.removeprefix(TLS_MOUNT).lstrip("/"))
        if value == "0.0.0.0":
            return "127.0.0.1"  # tests bind loopback only
        if value == "http://jaeger:4317":
            return f"http://127.0.0.1:{self.otlp_port}"
        if value.isdigit() and int(value) in self.container_ports(service):
            return str(self.port(service, int(value)))

        def address(match: re.Match) -> str:
            name, port = match.group(1), int(match.group(2))
            if name in ("127.0.0.1", "localhost"):
                name = service
            return f"127.0.0.1:{self.port(name, port)}"

        return re.sub(r"\b(target|draft|gateway|127\.0\.0\.1|localhost):(\d+)\b", address, value)

    def container_ports(self, service: str) -> set[int]:
        spec = self.compose["services"][service]
        ports = {int(p) for p in spec.get("expose", [])}
        ports |= {int(str(p).rsplit(":", 1)[-1]) for p in spec.get("ports", [])}
        return ports

    def environment(self, service: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "OTEL_"))}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        for key, value in self.compose["services"][service]["environment"].items():
            env[key] = self.translate(service, value)
        env["TANDEM_CACHE_DIR"] = os.environ["TANDEM_CACHE_DIR"]  # the `models` volume
        env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
        return env

    def command(self, service: str) -> list[str]:
        return [self.translate(service, part) for part in self.compose["services"][service]["command"]]

    def start(self, service: str) -> None:
        self.processes[service] = subprocess.Popen(
            self.command(service), env=self.environment(service), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )

    def healthcheck(self, service: str) -> subprocess.CompletedProcess:
        test = self.compose["services"][service]["healthcheck"]["test"]
        assert test[0] == "CMD"
        return subprocess.run([self.translate(service, part) for part in test[1:]], env=self.environment(service),
                              capture_output=True, text=True, timeout=30, check=False)

    def wait_healthy(self, service: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            process = self.processes[service]
            if process.poll() is not None:
                raise RuntimeError(f"{service} exited with {process.returncode}: {process.stderr.read()[-3000:]}")
            if self.healthcheck(service).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service} not healthy after {timeout_s}s")
            time.sleep(0.3)

    def stop(self) -> None:
        for service in reversed(list(self.processes)):
            process = self.processes[service]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # what `docker compose down` sends
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sink = OtlpReceiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    sink.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink
    server.stop(None)


@pytest.fixture(scope="module")
def local(compose, otlp, tiny_dir, tiny_draft_dir) -> Iterator[LocalCompose]:
    variables = {"TANDEM_TARGET_MODEL": str(tiny_dir), "TANDEM_DRAFT_MODEL": str(tiny_draft_dir),
                 "TANDEM_NUM_SPECULATIVE_TOKENS": "3"}
    stack = LocalCompose(compose, variables, otlp.port)
    try:
        for service in TANDEM_SERVICES:
            stack.start(service)
        for service in TANDEM_SERVICES:
            stack.wait_healthy(service)
        yield stack
    finally:
        stack.stop()


def test_services_start_as_compose_runs_them_and_serve_a_request(local, otlp) -> None:
    assert local.command("target")[:2] == ["tandem", "target"]
    base = f"http://127.0.0.1:{local.port('gateway', 8000)}"
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    reply = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": model, "prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0, "speculation": "on"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["speculative_decoding"]["rounds"] > 0
    # Each healthcheck passes (exit 0) while its service serves; a dead address fails it.
    for service in TANDEM_SERVICES:
        result = local.healthcheck(service)
        assert result.returncode == 0 and "SERVING" in result.stdout, (service, result.stdout, result.stderr)
    dead = subprocess.run([sys.executable, "-m", "tandem.rpc.healthcheck", f"127.0.0.1:{free_port()}", "--timeout", "1"],
                          capture_output=True, text=True, timeout=30, check=False)
    assert dead.returncode == 1 and "UNAVAILABLE" in dead.stdout
    # The spans reach the OTLP endpoint compose points them at, under the compose service names.
    deadline = time.monotonic() + 20
    while {s.service for s in otlp.spans} != {"tandem-target", "tandem-draft", "tandem-gateway"}:
        assert time.monotonic() < deadline, {s.service for s in otlp.spans}
        time.sleep(0.1)


# -- Prometheus scraping the stack -------------------------------------------------------------


@pytest.fixture(scope="module")
def prometheus(local, tmp_path_factory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "the Debian package `prometheus` is needed (.ci/run installs it)"
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
    for job in config["scrape_configs"]:
        for group in job["static_configs"]:
            group["targets"] = [local.translate(group["labels"]["service"], t) for t in group["targets"]]
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen(
        [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stderr.read()[-3000:]
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def query(url: str, expr: str) -> list[dict]:
    reply = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def test_prometheus_scrapes_all_three_and_reads_back_the_acceptance_rate(local, prometheus) -> None:
    base = f"http://127.0.0.1:{local.port('gateway', 8000)}"
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    reply = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": model, "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "speculation": "on"})
    assert reply.status_code == 200
    exposed = {service: metric_value(httpx.get(f"http://127.0.0.1:{local.port(service, port)}/metrics").text,
                                     "tandem_spec_decode_acceptance_rate")
               for service, port in (("gateway", 8000), ("draft", 9052), ("target", 9053))}

    deadline = time.monotonic() + 30
    while True:
        up = query(prometheus, "up")
        result = {r["metric"]["service"]: float(r["value"][1])
                  for r in query(prometheus, "tandem_spec_decode_acceptance_rate")}
        if len(up) == 3 and all(r["value"][1] == "1" for r in up) and result == pytest.approx(exposed):
            break
        assert time.monotonic() < deadline, (up, result, exposed)
        time.sleep(0.3)
    assert 0.0 < result["gateway"] <= 1.0
    assert {r["metric"]["job"] for r in up} == {"tandem-gateway", "tandem-draft", "tandem-target"}

    # The alert rules are loaded and evaluate without error against the real series.
    while True:
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = {r["name"]: r["health"] for g in groups for r in g["rules"]}
        if set(rules.values()) == {"ok"}:
            break
        assert time.monotonic() < deadline and "err" not in rules.values(), rules
        time.sleep(0.3)
    assert set(rules) == {"TandemLowAcceptanceRate", "TandemHighFallbackRate", "TandemHighErrorRate",
                          "TandemSlowTimeToFirstToken"}

    # Every dashboard query is valid PromQL over these series, and the headline panels have data.
    panels = json.loads(DASHBOARD.read_text())["panels"]
    headline = [("Sessions by mode", "A"), ("Speculation rounds/s", "A"), ("Acceptance rate over time", "A")]
    while True:
        answered = {}
        for panel in panels:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "1m")
                answered[(panel["title"], target["refId"])] = query(prometheus, expr)
        if all(answered[key] for key in headline):  # rates need two scrapes of the series
            break
        assert time.monotonic() < deadline, {key: answered[key] for key in headline}
        time.sleep(0.5)


# -- the same with deploy/compose.tls.yaml -------------------------------------------------------


@pytest.fixture(scope="module")
def local_tls(compose, otlp, tiny_dir, tmp_path_factory) -> Iterator[LocalCompose]:
    """The services under compose.yaml + deploy/compose.tls.yaml, with certificates from
    deploy/tls/make-certs.sh (as the override's comment tells an operator to make them)."""
    assert shutil.which("openssl"), "openssl is needed to run deploy/tls/make-certs.sh"
    tls_dir = tmp_path_factory.mktemp("tls")
    subprocess.run(["bash", str(REPO / "deploy" / "tls" / "make-certs.sh"), str(tls_dir)], check=True,
                   capture_output=True, timeout=60)
    merged = with_override(compose, yaml.safe_load(TLS_OVERRIDE.read_text()))
    variables = {"TANDEM_TARGET_MODEL": str(tiny_dir), "TANDEM_DRAFT_MODEL": "ngram",
                 "TANDEM_NUM_SPECULATIVE_TOKENS": "3", "TANDEM_INTERNAL_TOKEN": "compose-token-0123"}
    stack = LocalCompose(merged, variables, otlp.port, tls_dir=tls_dir)
    try:
        for service in TANDEM_SERVICES:
            stack.start(service)
        for service in TANDEM_SERVICES:
            stack.wait_healthy(service)
        yield stack
    finally:
        stack.stop()


def test_with_the_tls_override_every_hop_is_tls_and_clients_use_the_ca(local_tls) -> None:
    ca = str(local_tls.tls_dir / "ca.pem")
    base = f"https://127.0.0.1:{local_tls.port('gateway', 8000)}"
    model = httpx.get(f"{base}/v1/models", timeout=10, verify=ca).json()["data"][0]["id"]
    reply = httpx.post(f"{base}/v1/completions", timeout=60, verify=ca, json={
        "model": model, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0, "speculation": "on"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["speculative_decoding"]["rounds"] > 0  # gateway -> draft -> target, all TLS
    for service in TANDEM_SERVICES:
        result = local_tls.healthcheck(service)  # the container's own TANDEM_TLS_* settings
        assert result.returncode == 0 and "SERVING" in result.stdout, (service, result.stdout, result.stderr)
    plaintext = subprocess.run([sys.executable, "-m", "tandem.rpc.healthcheck",
                                f"127.0.0.1:{local_tls.port('target', 50053)}", "--timeout", "3"],
                               env={k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")},
                               capture_output=True, text=True, timeout=30, check=False)
    assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stdout
