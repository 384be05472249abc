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

Memory: entries take at most ``max_positions`` (the engine gives them a quarter of the KV budget)
and only the budget's room that live sessions do not reserve, and give it back (least recently used
first) whenever a new session needs it (``SessionStore``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import DynamicCache

from target_service import kv_cache

MIN_TOKENS = 16  # a shorter shared prefix saves less than the copy and the lookup cost
DEFAULT_POSITIONS = 1 << 16  # the most positions kept when the target has no KV budget
BUDGET_SHARE = 4  # of a KV budget, entries take at most 1/BUDGET_SHARE


@dataclass
class _Entry:
    tokens: tuple[int, ...]  # what the cache holds, one position each
    cache: DynamicCache
    positions: int  # what it takes of the budget (its buffers' room)


class PrefixCache:
    def __init__(self, max_positions: int = DEFAULT_POSITIONS, min_tokens: int = MIN_TOKENS) -> None:
        self.min_tokens = min_tokens
        self.max_positions = max_positions
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
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
        if held < self.min_tokens:
            return
        kv_cache.truncate(cache, held)
        kept = tuple(tokens[:held])
        for key, entry in list(self._entries.items()):  # an entry the new one extends says nothing more
            if len(entry.tokens) <= held and kept[: len(entry.tokens)] == entry.tokens:
                self._remove(key)
        entry = _Entry(kept, cache, kv_cache.capacity(cache))
        self._entries[self._next_key] = entry
        self._next_key += 1
        self.positions += entry.positions
        self.shrink_to(self.max_positions if room is None else min(room, self.max_positions))

    def lookup(self, prompt: Sequence[int]) -> tuple[DynamicCache, int] | None:
        """A copy of the cache of the longest kept prefix of ``prompt`` and its length, leaving at least
        the prompt's last token to prefill (it scores the first generated token); None under ``min_tokens``."""
        best_key, best = None, 0
        limit = len(prompt) - 1
        for key, entry in self._entries.items():
            common = _common_prefix(entry.tokens, prompt, limit)
            if common > best:
                best_key, best = key, common
        if best_key is None or best < self.min_tokens:
            return None
        self._entries.move_to_end(best_key)
        return kv_cache.copy_prefix(self._entries[best_key].cache, best), best

    def shrink_to(self, positions: int) -> None:
        """Drops the least recently used entries until the rest take at most ``positions``."""
        while self._entries and self.positions > max(0, positions):
            self._remove(next(iter(self._entries)))

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.positions -= entry.positions


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """The length of the longest common prefix of a and b, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n <= 0 or a[0] != b[0]:
        return 0
    if list(a[:n]) == list(b[:n]):
        return n
    low, high = 1, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if list(a[:middle]) == list(b[:middle]):
            low = middle
        else:
            high = middle
    return low
