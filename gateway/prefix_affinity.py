"""Which target holds the beginning of a prompt: a new session goes where its prefix is cached.

Each target keeps the KV caches of sessions that ended (``target_service.prefix_cache``) and
prefills only what a new prompt adds to the longest of them. In a pool that pays only if the next
turn of a conversation lands on the target that served the last one, which placement by load alone
leaves to chance (one in N). So the gateway remembers, per target, the token blocks of the sessions
it placed there (``tandem.token_blocks``: chained hashes of 16-token blocks, the most recent :data:`MAX_BLOCKS`
per target) and, among the members placement may choose, prefers the one holding the longest
prefix of the new prompt, unless that member carries more than twice the least load plus one
session: a cached prefix saves a prefill, not a wait behind a crowd.

Invariant: this only narrows the members placement chooses among; with no prefix known (or too
short to matter) placement is by load alone, as without it. A target that lost its cache (a
restart) only costs a prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from tandem.token_blocks import BLOCK, block_hashes

MAX_BLOCKS = 1 << 16  # remembered per target, the least recently used forgotten first


class PrefixAffinity:
    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def remember(self, address: str, tokens: Sequence[int]) -> None:
        """The target at ``address`` holds (or will hold, once its session ends) ``tokens``' cache."""
        blocks = self._blocks.setdefault(address, OrderedDict())
        for h in block_hashes(tokens):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def forget(self, address: str) -> None:
        self._blocks.pop(address, None)

    def held(self, address: str, hashes: Sequence[int]) -> int:
        """Tokens of the prompt whose ``hashes`` these are that the target holds, as a prefix."""
        blocks = self._blocks.get(address)
        if not blocks:
            return 0
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        return n * BLOCK

    def narrower(self, prompt: Sequence[int]) -> Callable[[list[Any]], list[Any]]:
        """For ``Pool.place(prefer=...)``: the members (pool ``Member`` objects) holding the longest
        prefix of ``prompt`` among those not too loaded, or all of them when none holds one."""
        hashes = block_hashes(prompt)

        def narrow(members: list[Any]) -> list[Any]:
            if not hashes or not members:
                return members
            least = min(m.load for m in members)
            fit = [m for m in members if m.load <= 2 * least + 1]
            best = max(self.held(m.address, hashes) for m in fit)
            return [m for m in fit if self.held(m.address, hashes) == best] if best else members

        return narrow
