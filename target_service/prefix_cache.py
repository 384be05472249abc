"""KV caches of sessions that ended, kept so that a prompt that starts the same way prefills only the rest.

A chat client sends the whole conversation every turn: the new prompt is the last turn's prompt,
its answer and the next message. Without this, the target prefills all of it again, and the
client waits for that before its first token (figures: docs/target.md#prefix-cache). With it, a new
session starts from a copy of the longest cached prefix of its prompt and prefills the tokens after
it. Sessions sharing a system prompt, and a gateway's re-prefill of a session it moves, gain alike.

Invariant: an entry's cache holds exactly the keys and values of its ``tokens``, as a prefill or
the session's own passes wrote them, each position a function of the tokens up to it only. So a
prefix of an entry is what a prefill of that prefix would write (bit for bit where the runner
computes each row as a one-token step, ``ModelRunner.row_exact``; up to float summation order
elsewhere, as chunked prefill already is), and a session started from it decodes what a session
prefilled from scratch would.

Lookup: entries are indexed by the chained hashes of their 16-token blocks
(``tandem.token_blocks``), so finding the longest kept prefix of a prompt costs a dictionary lookup
per block of it, whatever the number of entries, and one comparison of the tokens found.

Memory: entries take at most ``max_positions`` (the engine gives them a quarter of the KV budget)
and only the budget's room that live sessions do not reserve, and give it back (least recently used
first) whenever a new session needs it (``SessionStore``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import DynamicCache

from tandem.token_blocks import BLOCK, block_hashes
from target_service import kv_cache

MIN_TOKENS = BLOCK  # a shorter shared prefix saves less than the copy and the lookup; every entry has a block
DEFAULT_POSITIONS = 1 << 16  # the most positions kept when the target has no KV budget
BUDGET_SHARE = 4  # of a KV budget, entries take at most 1/BUDGET_SHARE


@dataclass
class _Entry:
    tokens: tuple[int, ...]  # what the cache holds, one position each
    hashes: list[int]  # of its whole blocks
    cache: DynamicCache
    positions: int  # what it takes of the budget (its buffers' room)


class PrefixCache:
    def __init__(self, max_positions: int = DEFAULT_POSITIONS) -> None:
        self.max_positions = max_positions
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._holding: dict[int, dict[int, None]] = {}  # block hash -> the entries holding that block
        self._next_key = 0
        self.positions = 0  # taken by all entries

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, tokens: Sequence[int], cache: DynamicCache | None, room: int | None) -> None:
        """Keeps a finished or released session's cache (taking it over: the session lets go of it),
        cut to its committed tokens but the last (a verify pass may have written rejected drafts
        past them). ``room``: positions the budget has free now (None: no budget)."""
        if cache is None:
            return
        held = min(kv_cache.cache_length(cache), len(tokens) - 1)
        if held < MIN_TOKENS:
            return
        kv_cache.truncate(cache, held)
        kept = tuple(tokens[:held])
        hashes = block_hashes(kept)
        # An entry the new one extends says nothing more: it holds the new one's first block, then
        # only its blocks, then only its tokens.
        for key in list(self._holding.get(hashes[0], {})):
            entry = self._entries[key]
            if (len(entry.tokens) <= held and entry.hashes == hashes[: len(entry.hashes)]
                    and kept[: len(entry.tokens)] == entry.tokens):
                self._remove(key)
        entry = _Entry(kept, hashes, cache, kv_cache.capacity(cache))
        key, self._next_key = self._next_key, self._next_key + 1
        self._entries[key] = entry
        for h in hashes:
            self._holding.setdefault(h, {})[key] = None
        self.positions += entry.positions
        self.shrink_to(self.max_positions if room is None else min(room, self.max_positions))

    def lookup(self, prompt: Sequence[int]) -> tuple[DynamicCache, int] | None:
        """A copy of the cache of the longest kept prefix of ``prompt`` and its length, leaving at least
        the prompt's last token to prefill (it scores the first generated token); None under :data:`MIN_TOKENS`."""
        limit = len(prompt) - 1
        hashes = block_hashes(prompt[:limit])
        depth = 0
        while depth < len(hashes) and hashes[depth] in self._holding:
            depth += 1
        if depth == 0:
            return None
        # Every holder of the deepest block shares the prompt's first ``depth`` blocks; which goes
        # furthest into the next one (which no entry holds whole)?
        shared, end = depth * BLOCK, min(limit, (depth + 1) * BLOCK - 1)
        best_key, best = None, -1
        for key in reversed(self._holding[hashes[depth - 1]]):  # the most recent first
            tokens = self._entries[key].tokens
            common = shared + common_prefix(tokens[shared:end], prompt[shared:end], end - shared)
            if common > best:
                best_key, best = key, common
            if best == end:
                break
        if best < MIN_TOKENS or self._entries[best_key].tokens[:shared] != tuple(prompt[:shared]):
            return None  # too short to pay, or a hash collision
        self._entries.move_to_end(best_key)
        return kv_cache.copy_prefix(self._entries[best_key].cache, best), best

    def shrink_to(self, positions: int) -> None:
        """Drops the least recently used entries until the rest take at most ``positions``."""
        while self._entries and self.positions > max(0, positions):
            self._remove(next(iter(self._entries)))

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.positions -= entry.positions
        for h in entry.hashes:
            holders = self._holding.get(h)
            if holders is not None:
                holders.pop(key, None)
                if not holders:
                    del self._holding[h]


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """The length of the longest common prefix of a and b, at most ``limit``."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
