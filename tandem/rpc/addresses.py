"""Pool addresses: ``--target-address`` / ``--draft-address`` lists and the DNS names in them.

A pool is given as comma-separated ``host:port`` entries. An IP literal or ``localhost`` is one
member. Any other host name stands for every address it resolves to (a Kubernetes headless Service
or compose's service name with ``deploy.replicas``), so resolving it again later shows the pool
grown or shrunk. A name that resolves to nothing is left out (logged by the caller) and tried again
at the next resolution: a pool's DNS record may lag its pods.

Invariant: :func:`resolve` returns each member once, as ``ip:port`` (IPv6 in brackets) or
``localhost:port``, in the order the entries were given, with the host name it was found under:
the name a TLS client checks the member's certificate against (tandem.rpc.security).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

# (host, port) -> the IP addresses the host resolves to.
Lookup = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True)
class Entry:
    """One comma-separated entry of a pool's address list."""

    host: str
    port: int

    @property
    def literal(self) -> bool:
        """An IP address or ``localhost``: a member as given, never resolved."""
        if self.host == "localhost":
            return True
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    def member(self, ip: str | None = None) -> str:
        host = ip if ip is not None else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


def parse(spec: str, what: str = "address") -> list[Entry]:
    """The entries of ``spec`` ("a:1,b:2"); ValueError naming the bad entry otherwise."""
    entries: list[Entry] = []
    for raw in spec.split(","):
        text = raw.strip()
        if not text:
            continue
        host, sep, port = text.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{what} {text!r} is not host:port")
        entries.append(Entry(host, int(port)))
    if not entries:
        raise ValueError(f"no {what} given")
    return entries


async def system_lookup(host: str, port: int) -> list[str]:
    """The host's addresses from the system resolver (IPv4 and IPv6)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


async def resolve(entries: list[Entry], lookup: Lookup = system_lookup) -> tuple[dict[str, str], list[str]]:
    """(members, problems): every entry's members in order, deduplicated, each with the host name
    of its entry, and one line per name that resolved to nothing."""
    members: dict[str, str] = {}
    problems: list[str] = []
    for entry in entries:
        if entry.literal:
            found = [entry.member()]
        else:
            try:
                found = [entry.member(ip) for ip in await lookup(entry.host, entry.port)]
            except OSError as exc:
                found = []
                problems.append(f"{entry.host} does not resolve: {exc}")
            else:
                if not found:
                    problems.append(f"{entry.host} resolves to no address")
        for member in found:
            members.setdefault(member, entry.host)
    return members, problems
