"""``tandem serve --targets N --drafts M``: the children's names, ports and command lines.

Names: with one target and one draft the children are ``target``, ``draft`` and ``gateway``; with
more of either, ``target-0`` .. ``target-{N-1}`` and ``draft-0`` .. ``draft-{M-1}`` (both roles
numbered as soon as either has several, so a fleet's names do not depend on which role grew).

Ports (deterministic): target i (0-based) serves gRPC on ``target_port + 2*i`` and metrics on
``target_metrics_port + 2*i``; draft j on ``draft_port + 2*j`` and ``draft_metrics_port + 2*j``. With
the defaults (target 50053, draft 50052, metrics 9053 / 9052) targets get 50053, 50055, ... and
drafts 50052, 50054, ..., clear of each other and of the gateway's 50051 gRPC / 8000 HTTP. A
configuration in which two children would share a port is refused before anything starts
(:class:`FleetError`), and so is a port another process holds (:func:`check_ports_free`).

Port 0: a gRPC or HTTP port of 0 means "any free port". The supervisor must know each port to
health-check the child and tell the others where it is, so it picks a distinct free port per child
up front (:func:`plan`) and passes it on; a restarted child gets the same one. A metrics port of 0
means metrics off (as for ``tandem target`` / ``tandem draft``), for every child of that role. The
ports picked are printed in the ready block; :func:`read_ready_block` reads them back.
"""

from __future__ import annotations

import re
import socket
import sys
from contextlib import ExitStack
from dataclasses import dataclass

from tandem import models
from tandem.config import ServeSettings

MAX_PORT = 65535


class FleetError(ValueError):
    """A fleet that cannot start: two children on one port, a port out of range or held by another process."""


@dataclass(frozen=True)
class Member:
    """One target or draft: its name, gRPC port and metrics port (0 = off)."""

    name: str
    port: int
    metrics_port: int


@dataclass(frozen=True)
class Fleet:
    """Every child's ports, resolved (no gRPC or HTTP port is 0 any more)."""

    host: str  # where the children are reached from this machine
    targets: tuple[Member, ...]
    drafts: tuple[Member, ...]
    grpc_port: int  # the gateway's
    http_port: int

    @property
    def single(self) -> bool:
        return len(self.targets) == 1 and len(self.drafts) == 1

    def address(self, member: Member) -> str:
        return f"{self.host}:{member.port}"

    @property
    def target_addresses(self) -> str:
        """Every target, comma-separated: the drafts' and the gateway's ``--target-address``."""
        return ",".join(self.address(m) for m in self.targets)

    @property
    def draft_addresses(self) -> str:
        return ",".join(self.address(m) for m in self.drafts)

    @property
    def gateway_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"


def connect_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def names(role: str, count: int, numbered: bool) -> list[str]:
    return [f"{role}-{i}" for i in range(count)] if numbered else [role]


def plan(s: ServeSettings) -> Fleet:
    """The fleet's ports by the scheme above; refuses collisions, then picks the free ports asked for (0)."""
    numbered = s.targets > 1 or s.drafts > 1
    wanted: list[tuple[str, int]] = [("gateway HTTP", s.http_port), ("gateway gRPC", s.grpc_port)]
    roles = (("target", s.targets, s.target_port, s.target_metrics_port),
             ("draft", s.drafts, s.draft_port, s.draft_metrics_port))
    for role, count, port, metrics_port in roles:
        for i, name in enumerate(names(role, count, numbered)):
            wanted.append((f"{name} gRPC", port and port + 2 * i))
            wanted.append((f"{name} metrics", metrics_port and metrics_port + 2 * i))
    check_ports(wanted, s.targets, s.drafts)
    taken = {port for _, port in wanted if port}
    free = iter(free_ports(s.host, sum(1 for label, port in wanted if not port and "metrics" not in label), taken))
    resolved = {label: port or (0 if "metrics" in label else next(free)) for label, port in wanted}

    def members(role: str, count: int) -> tuple[Member, ...]:
        return tuple(Member(n, resolved[f"{n} gRPC"], resolved[f"{n} metrics"]) for n in names(role, count, numbered))

    return Fleet(connect_host(s.host), members("target", s.targets), members("draft", s.drafts),
                 resolved["gateway gRPC"], resolved["gateway HTTP"])


def check_ports(wanted: list[tuple[str, int]], targets: int, drafts: int) -> None:
    """Refuses a port out of range or one that two children would share (0s are picked later, apart)."""
    hint = (f" (with --targets {targets} --drafts {drafts}, target i uses --target-port + 2*i and "
            "--target-metrics-port + 2*i, draft j --draft-port + 2*j and --draft-metrics-port + 2*j)")
    owner: dict[int, str] = {}
    for label, port in wanted:
        if not 0 <= port <= MAX_PORT:
            raise FleetError(f"{label} would use port {port}, out of range{hint}")
        if port and port in owner:
            raise FleetError(f"port {port} would be used twice: by {owner[port]} and {label}{hint}")
        owner.setdefault(port, label)


def check_ports_free(f: Fleet, host: str) -> None:
    """Refuses a fleet one of whose ports another process holds now, before any child starts: each
    child would otherwise load its model and only then fail to bind (gRPC servers here do not share
    a port, see ``tandem.rpc.endpoints``). A host this machine cannot bind is left to the children."""
    import errno

    flags = {"target": ("--target-port", "--target-metrics-port"), "draft": ("--draft-port", "--draft-metrics-port")}
    ports = [("the gateway's HTTP", "--http-port", f.http_port), ("the gateway's gRPC", "--grpc-port", f.grpc_port)]
    for role, members in (("target", f.targets), ("draft", f.drafts)):
        for m in members:
            ports += [(f"{m.name}'s gRPC", flags[role][0], m.port),
                      (f"{m.name}'s metrics", flags[role][1], m.metrics_port)]
    bind_host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    for label, flag, port in ports:
        if not port:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: past connections do not count
            try:
                sock.bind((bind_host, port))
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise FleetError(f"port {port} ({label}, {flag}) is in use by another process on {bind_host}: "
                                     f"stop it, or choose another port with {flag}") from None
                if error.errno == errno.EACCES:
                    raise FleetError(f"port {port} ({label}, {flag}) needs privileges this user lacks on "
                                     f"{bind_host}: choose a port above 1023 with {flag}") from None
                return  # a host this machine cannot bind: the children will say so


def free_ports(host: str, count: int, avoid: set[int]) -> list[int]:
    """``count`` distinct ports free on ``host`` now, none in ``avoid`` (held open until all are picked)."""
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ports: list[int] = []
    with ExitStack() as held:
        while len(ports) < count:
            sock = held.enter_context(socket.socket(family, socket.SOCK_STREAM))
            try:
                sock.bind((host, 0))
            except OSError:  # a host name this machine cannot bind: the children will say so
                sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if port not in avoid:
                ports.append(port)
    return ports


def commands(s: ServeSettings, fleet: Fleet) -> list[tuple[str, list[str], str]]:
    """(name, argv, health address) per child in start order: targets, drafts, gateway."""
    py = [sys.executable, "-m", "tandem.cli"]
    common = ["--host", s.host, "--log-level", s.log_level, *_tls_flags(s)]
    device = ["--device", s.device, "--dtype", s.dtype]
    served = ["--served-model-name", s.served_model_name] if s.served_model_name else []
    draft_model = models.resolve_draft_spec(s.draft_model, s.target_model)
    k = ["--num-speculative-tokens", str(s.num_speculative_tokens)]
    out = []
    for t in fleet.targets:
        out.append((t.name, [*py, "target", *common, *device, *served, "--target-model", s.target_model,
                             "--port", str(t.port), "--metrics-port", str(t.metrics_port)], fleet.address(t)))
    for d in fleet.drafts:
        out.append((d.name, [*py, "draft", *common, *device, "--draft-model", draft_model,
                             "--target-model", s.target_model, "--target-address", fleet.target_addresses,
                             "--port", str(d.port), "--metrics-port", str(d.metrics_port), *k], fleet.address(d)))
    out.append(("gateway", [*py, "gateway", *common, *served, "--target-model", s.target_model,
                            "--target-address", fleet.target_addresses, "--draft-address", fleet.draft_addresses,
                            "--http-port", str(fleet.http_port), "--grpc-port", str(fleet.grpc_port), *k,
                            "--stream-smoothing", s.stream_smoothing, *_sampling_flags(s), *_auth_flags(s)],
                fleet.gateway_address))
    return out


def _tls_flags(s: ServeSettings) -> list[str]:
    """Every child's TLS flags (paths, not secrets; the internal token goes in the environment)."""
    given = {"--tls-cert": s.tls_cert, "--tls-key": s.tls_key, "--tls-ca": s.tls_ca,
             "--tls-server-name": s.tls_server_name}
    flags = [part for flag, value in given.items() if value for part in (flag, value)]
    return [*flags, "--insecure"] if s.insecure else flags


def _sampling_flags(s: ServeSettings) -> list[str]:
    """The gateway's ``--generation-config`` and ``--chat-template`` where they are not the default."""
    flags = [] if s.generation_config == "auto" else ["--generation-config", s.generation_config]
    return flags if s.chat_template is None else [*flags, "--chat-template", s.chat_template]


def _auth_flags(s: ServeSettings) -> list[str]:
    """The gateway's API key flags but the keys themselves (they go in its environment)."""
    flags = ["--api-key-file", s.api_key_file] if s.api_key_file else []
    if s.http_tls_cert and s.http_tls_key:
        flags += ["--http-tls-cert", s.http_tls_cert, "--http-tls-key", s.http_tls_key]
    if s.max_concurrent_per_key:
        flags += ["--max-concurrent-per-key", str(s.max_concurrent_per_key)]
    if s.rate_limit_per_key:
        flags += ["--rate-limit-per-key", f"{s.rate_limit_per_key:g}"]
    return [*flags, "--metrics-auth"] if s.metrics_auth else flags


def ready_block(s: ServeSettings, fleet: Fleet) -> str:
    """What ``tandem serve`` prints once every child is SERVING: each service with its address."""
    h = fleet.host
    model = s.served_model_name or models.default_served_name(s.target_model)
    draft_about = f"({models.resolve_draft_spec(s.draft_model, s.target_model)}, K={s.num_speculative_tokens})"

    def metrics(port: int) -> str:
        return f"http://{h}:{port}/metrics" if port else "off"

    members = (*fleet.drafts, *fleet.targets)
    width = max(len("gateway gRPC"), *(len(m.name + " gRPC") for m in members))

    def row(label: str, text: str) -> str:
        return f"  {label:<{width}}  {text}"

    scheme = "https" if s.http_tls_cert else "http"
    lines = ["", "tandem is ready", row("OpenAI API", f"{scheme}://{h}:{fleet.http_port}/v1   (model: {model})"),
             row("gateway gRPC", f"{fleet.gateway_address}   (tandem.v1.GatewayService)")]
    if fleet.single:  # as it always was
        (draft,), (target,) = fleet.drafts, fleet.targets
        lines += [row("draft gRPC", f"{fleet.address(draft)}   {draft_about}"),
                  row("target gRPC", fleet.address(target)),
                  row("metrics", f"{scheme}://{h}:{fleet.http_port}/metrics  {metrics(draft.metrics_port)}  "
                      + metrics(target.metrics_port))]
    else:
        for m in members:
            about = f"{draft_about}   " if m in fleet.drafts else ""
            lines.append(row(f"{m.name} gRPC", f"{fleet.address(m)}   {about}metrics {metrics(m.metrics_port)}"))
        lines.append(row("metrics", f"{scheme}://{h}:{fleet.http_port}/metrics   (gateway)"))
    if s.api_keys or s.api_key_file:
        lines.append(row("API keys", "required (Authorization: Bearer KEY)"))
    if s.tls_cert:
        lines.append(row("gRPC TLS", "mutual (client certificates signed by --tls-ca)" if s.tls_ca else "on"))
    lines += ["Press Ctrl-C to stop.", ""]
    return "\n".join(lines)


_GRPC_LINE = re.compile(r"^\s+(gateway|(?:target|draft)(?:-\d+)?) gRPC\s+(\S+)")
_HTTP_LINE = re.compile(r"^\s+OpenAI API\s+https?://(\S+?)/v1")


def read_ready_block(text: str) -> dict[str, str]:
    """Each child's gRPC address by name (``gateway``, ``target-0``, ...) and the gateway's HTTP
    address as ``http``, from ``tandem serve``'s output: how a test that asked for port 0 learns them."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        if m := _GRPC_LINE.match(line):
            found[m[1]] = m[2]
        elif m := _HTTP_LINE.match(line):
            found["http"] = m[1]
    return found
