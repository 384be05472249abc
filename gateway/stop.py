"""Stop strings over a stream of text deltas.

A stop string may arrive split across deltas ("<|en" + "d|>"), so text that could be the beginning
of a stop string is held back until the next delta decides it. On a match the text before the stop
string is released and the rest is dropped (OpenAI semantics: the stop string is not returned;
vLLM's ``include_stop_str_in_output`` returns it too).
When generation ends for another reason, :meth:`flush` releases the held-back text.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str], include: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._include = include
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Adds a delta; returns the text that is now safe to emit. After a match (``matched`` is
        set) it returns the text up to the stop string (through it with ``include``), then nothing."""
        if self.matched is not None:
            return ""
        buffer = self._held + text
        hits = [(buffer.find(s), s) for s in self._stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, self.matched = min(hits)
            self._held = ""
            return buffer[: index + len(self.matched) if self._include else index]
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Releases held-back text (when generation ended without a match)."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for length in range(min(len(s) - 1, len(buffer)), best, -1):
                if buffer.endswith(s[:length]):
                    best = length
                    break
        return best
