"""A pool of upstreams of one role (targets or drafts): membership, health state and placement.

The gateway fronts pools: ``--target-address`` and ``--draft-address`` list members, and DNS names
among them stand for every address they resolve to (:mod:`tandem.rpc.addresses`), resolved again
by the monitor so a pool grows and shrinks with its Deployment. A member is *usable* while its last
health check found it SERVING with the gateway's tokenizer and nothing has taken it out since (a
session that saw it die or hang takes it out at once; the next check that finds it SERVING takes it
back). A draft member is usable only while its circuit breaker allows speculation, too.

Placement: a new session goes to the usable member with the least load: the sessions this gateway
placed there, those of other gateways (what the member last reported beyond this gateway's own),
and its queued passes; ties go round-robin. A caller may first narrow the members by what it
measured (speculative legs go to the drafts that commit the most tokens per second for their
target: :mod:`gateway.draft_speeds`). A target session stays on its member until it ends or the
member fails; a draft serves one leg at a time, so every speculative leg is placed anew.

Invariant: ``Member.sessions`` counts exactly the :class:`Placement` objects not yet closed; a
member that left DNS stays (not usable) until its last placement closes.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gateway.breaker import DraftBreaker
from tandem.rpc import addresses

log = logging.getLogger(__name__)

U = TypeVar("U")


@dataclass(eq=False)
class Member(Generic[U]):
    address: str
    client: U
    # From the last health check: SERVING with the gateway's tokenizer (None: not checked yet).
    serving: bool | None = None
    reachable: bool | None = None  # answered its health check with SERVING, whatever the tokenizer
    detail: str = "not checked yet"
    sessions: int = 0  # placed here by this gateway, not yet closed
    foreign_sessions: int = 0  # other gateways' sessions here, as of the member's last Info
    queued: int = 0  # passes waiting in the member (targets)
    leaving: bool = False  # gone from DNS: no new sessions
    was_serving: bool = False  # ever found serving (a member that comes back after that is logged)
    breaker: DraftBreaker | None = None  # drafts: this member's circuit breaker
    # Target sessions the gateway could not release here (the member was down): sent when it is back.
    owed_releases: set[str] = field(default_factory=set)

    @property
    def usable(self) -> bool:
        return bool(self.serving) and self.placeable

    @property
    def placeable(self) -> bool:
        """Not leaving and, for a draft, its breaker allows speculation."""
        return not self.leaving and (self.breaker is None or self.breaker.allows_speculation)

    @property
    def load(self) -> int:
        return self.sessions + self.foreign_sessions + self.queued

    def report(self, active_sessions: int, queued: int = 0) -> None:
        """What the member's ``Info`` says it runs. Only the part beyond this gateway's own count
        is kept, so that sessions this gateway ended since then are not counted again."""
        self.foreign_sessions = max(0, active_sessions - self.sessions)
        self.queued = queued

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"address": self.address, "serving": bool(self.serving), "detail": self.detail,
                                "sessions": self.sessions}
        if self.breaker is not None:
            body["breaker"] = self.breaker.state.value
        return body


class Placement(Generic[U]):
    """One session's (or leg's) claim on a member; :meth:`close` it exactly once (idempotent)."""

    def __init__(self, member: Member[U], changed: Callable[[Member[U]], None] = lambda member: None) -> None:
        self.member = member
        self._changed = changed
        member.sessions += 1
        self._open = True
        changed(member)

    @property
    def client(self) -> U:
        return self.member.client

    @property
    def address(self) -> str:
        return self.member.address

    def close(self) -> None:
        if self._open:
            self._open = False
            self.member.sessions -= 1
            self._changed(self.member)


class Pool(Generic[U]):
    def __init__(
        self,
        role: str,
        spec: str,
        connect: Callable[[str, str], U],
        *,
        lookup: addresses.Lookup = addresses.system_lookup,
        breaker: Callable[[], DraftBreaker] | None = None,
        close: Callable[[U], Awaitable[None]] | None = None,
    ) -> None:
        """``connect``: a client for an address and the host name it was found under (what its
        TLS certificate names); ``breaker``: a new breaker per member (drafts);
        ``close``: how to close a client of a member that left. Raises ValueError for a bad spec."""
        self.role = role
        self.spec = spec
        self._entries = addresses.parse(spec, f"{role} address")
        self._connect = connect
        self._lookup = lookup
        self._breaker = breaker
        self._close = close
        self.members: dict[str, Member[U]] = {}
        self._turn = itertools.count()
        self._problems: list[str] = []
        # Called with a member whenever its placed sessions change (the gateway's pool gauge).
        self.on_sessions: Callable[[Member[U]], None] = lambda member: None
        # Called with the address of a member that left the pool (what is kept about it goes too).
        self.on_removed: Callable[[str], None] = lambda address: None
        if all(entry.literal for entry in self._entries):  # known now: no need to wait for DNS
            for entry in self._entries:
                self._add(entry.member(), entry.host)

    @classmethod
    def of(cls, role: str, members: dict[str, U], breaker: Callable[[], DraftBreaker] | None = None) -> Pool[U]:
        """A fixed pool of ready clients (tests, in-process stacks): ``{address: client}``."""
        pool = cls.__new__(cls)
        pool.role, pool.spec, pool._entries = role, ",".join(members), []
        pool._connect, pool._lookup, pool._breaker, pool._close = (lambda address, _: members[address]), _no_lookup, breaker, None
        pool.members, pool._turn, pool._problems = {}, itertools.count(), []
        pool.on_sessions = lambda member: None
        pool.on_removed = lambda address: None
        for address in members:
            pool._add(address, address).serving = True
        return pool

    def _add(self, address: str, name: str) -> Member[U]:
        if address not in self.members:
            breaker = self._breaker() if self._breaker is not None else None
            self.members[address] = Member(address, self._connect(address, name), breaker=breaker)
        return self.members[address]

    async def resolve(self) -> None:
        """Resolves the pool's names again: new addresses join (checked before use), addresses
        that are gone leave once their sessions end."""
        if not self._entries:  # a fixed pool (Pool.of)
            return
        found, problems = await addresses.resolve(self._entries, self._lookup)
        for problem in problems:
            if problem not in self._problems:
                log.warning("%s pool: %s", self.role, problem)
        self._problems = problems
        for address, name in found.items():
            member = self.members.get(address)
            if member is None:
                log.info("%s pool: %s joins", self.role, address)
                self._add(address, name)
            elif member.leaving:
                member.leaving = False
        for address, member in list(self.members.items()):
            if address in found or (problems and not found):  # a failed lookup is not an empty pool
                continue
            if not member.leaving:
                log.info("%s pool: %s left DNS; it takes no new sessions", self.role, address)
                member.leaving = True
            if member.sessions == 0:
                del self.members[address]
                self.on_removed(address)
                if self._close is not None:
                    await self._close(member.client)

    def usable(self) -> list[Member[U]]:
        return [m for m in self.members.values() if m.usable]

    def place(self, avoid: frozenset[str] = frozenset(), anyhow: bool = False,
              prefer: Callable[[list[Member[U]]], list[Member[U]]] | None = None) -> Placement[U] | None:
        """A placement on the least-loaded usable member not in ``avoid`` (addresses), else on
        any usable member. With none usable, a member that answers its health check but was
        found unfit (another tokenizer) gets it, so that its refusal reaches the client rather
        than a vague "unavailable". ``anyhow``: failing all that, any member (a call the client
        insists on, e.g. ``speculation: "on"``). ``prefer``: narrows those members before the
        least-load rule (drafts: the measured fastest, :mod:`gateway.draft_speeds`). None when
        there is no such member either."""
        candidates = self._candidates() or ([m for m in self.members.values() if not m.leaving] if anyhow else [])
        preferred = [m for m in candidates if m.address not in avoid] or candidates
        if not preferred:
            return None
        if prefer is not None:
            preferred = prefer(preferred) or preferred
        turn = next(self._turn)
        order = {m.address: (i - turn) % len(preferred) for i, m in enumerate(preferred)}
        return Placement(min(preferred, key=lambda m: (m.load, order[m.address])), self.on_sessions)

    def _candidates(self) -> list[Member[U]]:
        return self.usable() or [m for m in self.members.values() if m.reachable and m.placeable]

    def can_place(self, avoid: frozenset[str] = frozenset()) -> bool:
        """Whether :meth:`place` would find a member outside ``avoid``."""
        return any(m.address not in avoid for m in self._candidates())

    def take_out(self, member: Member[U], why: str) -> None:
        """Stops placing sessions on ``member`` until a health check finds it SERVING again."""
        if member.serving is not False or member.reachable:
            log.warning("%s %s is out of the pool: %s", self.role, member.address, why)
        member.serving = member.reachable = False
        member.detail = why

    @property
    def serving(self) -> bool:
        return any(m.serving for m in self.members.values())

    def describe(self) -> str:
        """One line for logs and /health: each member and its state."""
        if not self.members:
            return self._unresolved()
        return "; ".join(f"{m.address} {m.detail}" for m in self.members.values())

    def unavailable(self) -> str:
        """Why no session can be placed, for the client: each member that is down, and why."""
        if not self.members:
            return self._unresolved()
        return "; ".join(f"the {self.role} service at {m.address} is unavailable ({m.detail})"
                         for m in self.members.values() if not m.usable) or f"every {self.role} service is busy"

    def _unresolved(self) -> str:
        return f"no {self.role} in {self.spec!r} resolved" + (f" ({'; '.join(self._problems)})" if self._problems else "")

    def to_json(self) -> dict[str, Any]:
        """The pool in /health: ``address``/``serving``/``detail`` as for one upstream, and the members."""
        return {"address": self.spec, "serving": self.serving, "detail": self.describe(),
                "members": [m.to_json() for m in self.members.values()]}


async def _no_lookup(host: str, port: int) -> list[str]:
    return []
