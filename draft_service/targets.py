"""The draft's pool of targets: which targets it may talk to, and one channel to each.

A gateway in front of pools of targets and drafts lets any draft serve a session held by any
target, so each ``Speculate`` names its target (``SpeculateRequest.target_address``) and the draft
opens the Verify stream, and sends a Release, to that one. :class:`TargetRouter` maps the name to
a :class:`TargetClient`, made on first use and kept (one channel per target, shared by all its
sessions).

Security invariant: the draft connects only to members of its configured ``--target-address``
list: the entries as given, and the addresses their DNS names resolve to (``tandem.rpc.addresses``).
An address outside that set is re-resolved once (the pool may have grown since the last
resolution) and then refused with :class:`UnknownTargetError`; a caller can never make the draft
open a channel to an address of its choosing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from draft_service.errors import TargetUnavailableError, UnknownTargetError
from draft_service.target_client import SERVING, TargetClient
from tandem.rpc import addresses

log = logging.getLogger(__name__)


# A request naming an address outside the last resolution makes the pool resolve again (a pod
# that just joined), at most this often.
RESOLVE_AGAIN_AFTER_S = 1.0


class TargetRouter:
    """The configured targets (``spec``: "host:port,..." as ``tandem draft --target-address``).

    ``default``: the first entry as given, the target of a request that names none (so a gateway
    that knows a single target works unchanged; a DNS name there is resolved by gRPC itself, as
    before pools). ``lookup`` and ``connect`` are seams for tests.
    """

    def __init__(
        self,
        spec: str,
        *,
        lookup: addresses.Lookup = addresses.system_lookup,
        connect: Callable[[str, str], TargetClient] = TargetClient,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.entries = addresses.parse(spec, "target address")  # ValueError on a malformed list
        self.default = self.entries[0].member()
        self._lookup = lookup
        self._connect = connect
        # The last resolution, in the order of the entries: member -> the host name it was found under.
        self._members: dict[str, str] = {}
        self._resolutions = 0  # completed resolutions: concurrent callers share one
        self._resolving = asyncio.Lock()
        self._clients: dict[str, TargetClient] = {}
        self._clock = clock
        self._resolved_at = -RESOLVE_AGAIN_AFTER_S  # when a request last made the pool resolve again

    @property
    def allowed(self) -> list[str]:
        """Every address a request may name: the entries as given, then their resolved members."""
        given = [entry.member() for entry in self.entries]
        return given + [member for member in self._members if member not in given]

    @property
    def members(self) -> list[str]:
        """The targets of the last resolution (ip:port; an IP literal or localhost as given)."""
        return list(self._members)

    def address_of(self, address: str) -> str:
        """The target a request's ``target_address`` stands for ("" = the default)."""
        return address or self.default

    async def resolve(self) -> list[str]:
        """Resolves the entries again (DNS names to every address they have now); the members."""
        members, problems = await addresses.resolve(self.entries, self._lookup)
        for problem in problems:
            log.warning("target pool: %s", problem)
        self._members = members
        self._resolutions += 1
        return list(members)

    async def client(self, address: str) -> TargetClient:
        """The channel to the target ``address`` names ("" = the default); UnknownTargetError when
        it is no member of the pool, even after resolving the pool again."""
        address = self.address_of(address)
        if address not in self.allowed:
            seen = self._resolutions
            async with self._resolving:
                # Nobody resolved while this call waited, and not just now: a caller naming
                # strangers does not make the draft ask DNS at the caller's rate.
                if self._resolutions == seen and self._clock() - self._resolved_at >= RESOLVE_AGAIN_AFTER_S:
                    self._resolved_at = self._clock()
                    await self.resolve()
            if address not in self.allowed:
                raise UnknownTargetError(
                    f"target_address {address!r} is not one of this draft's targets ({', '.join(self.allowed)}); "
                    f"the draft connects only to the targets it was started with (--target-address)"
                )
        return self._client(address)

    def _client(self, address: str) -> TargetClient:
        client = self._clients.get(address)
        if client is None:
            name = self._members.get(address) or addresses.parse(address)[0].host
            client = self._clients[address] = self._connect(address, name)
        return client

    async def wait_for_any(
        self, timeout_s: float | None = None, poll_s: float = 0.25, log_every_s: float = 10.0
    ) -> TargetClient:
        """Polls every target's health until one is SERVING and returns it (the first in the
        pool's order when several are). The pool is re-resolved each ``log_every_s`` (and while
        no name resolves), so targets may come up in any order, and after the draft.

        ``timeout_s`` None waits forever; otherwise TargetUnavailableError names every target.
        """
        started = last_log = last_resolve = time.monotonic()
        await self.resolve()
        while True:
            candidates = list(self._members) or [self.default]
            states = await asyncio.gather(*(self._client(a).health_state() for a in candidates))
            for address, state in zip(candidates, states):
                if state == SERVING:
                    return self._client(address)
            seen = ", ".join(f"{a}: {s}" for a, s in zip(candidates, states))
            now = time.monotonic()
            if timeout_s is not None and now - started >= timeout_s:
                raise TargetUnavailableError(f"no target is SERVING after {timeout_s:.0f}s ({seen})")
            if now - last_log >= log_every_s:
                log.info("waiting for a target to be SERVING (%s)", seen)
                last_log = now
            if not self._members or now - last_resolve >= log_every_s:
                await self.resolve()
                last_resolve = now
            await asyncio.sleep(poll_s)

    async def close(self) -> None:
        """Closes every channel (service shutdown)."""
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(client.close() for client in clients), return_exceptions=True)
