"""What speculation has measured at each sampling temperature: the prior of the up-front decision.

Whether speculation pays at a temperature depends on the host, the models and the text: as the
distributions flatten, fewer drafts are accepted, while the price of a round stays. A fixed cut
("decode autoregressively above 0.8") throws away a measured speedup where speculation still pays
(and OpenAI's SDKs send 1.0 unless told otherwise). So ``auto`` speculates from the start at any
temperature, and every session that speculated for at least a warm-up's worth of rounds reports,
as it ends, what it measured: its seconds per committed token while speculating over the target's
seconds per autoregressive step. Ratios below 1 mean speculation paid.

:class:`TemperaturePrior` keeps an exponential average of those ratios per temperature band, each
report weighted by the tokens its session speculated: a session that fell back after ten tokens
measured only its own first rounds, a session's worst (prompt lookup has nothing to copy yet), and
unweighted, a few such reports in a row lifted the greedy band over the bar and held back sessions
that speculate at twice the speed of plain decoding. A new
session at a band whose average says speculation is slower (above ``1 + margin`` over at least
``min_sessions`` reports) starts autoregressively, reason ``prior_slower``; one session in
``explore_every`` of those speculates anyway (and held-back sessions still probe later), so the
prior follows the host and the traffic instead of freezing on its first verdict.

Each band is kept apart by load too: the sessions in progress per target, the higher of the
count at the session's start and at its report (``load_band``: 1, 2-3, 4-7, 8+). Speculation that pays for one stream can cost a
target carrying eight (their blocks' rows share every pass, and on a CPU many rows make a pass
bound by arithmetic), and a verdict learned in a burst must not hold back the lone sessions after it.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

# Upper edges of the temperature bands (greedy is its own band); the last band is open.
BAND_EDGES = (0.0, 0.35, 0.75, 1.05, 1.5)
BAND_NAMES = ("0", "0-0.35", "0.35-0.75", "0.75-1.05", "1.05-1.5", "1.5+")


# Upper edges of the load bands: sessions in progress per target, the reporting one included.
LOAD_EDGES = (1, 3, 7)
LOAD_NAMES = ("1", "2-3", "4-7", "8+")


def band(temperature: float) -> str:
    """The name of the band ``temperature`` falls in (the label of the prior's metric)."""
    return BAND_NAMES[bisect.bisect_left(BAND_EDGES, temperature)]


def load_band(sessions: int) -> str:
    """The name of the load band of ``sessions`` in progress per target (the metric's ``load`` label)."""
    return LOAD_NAMES[bisect.bisect_left(LOAD_EDGES, max(1, sessions))]


@dataclass
class _Band:
    speculative: float = 0.0  # averaged speculative seconds of the reports (per token, times tokens)
    autoregressive: float = 0.0  # averaged step seconds the same tokens would have taken
    reports: int = 0
    held_back: int = 0  # sessions the prior started autoregressively since one last explored

    @property
    def ratio(self) -> float:
        """Speculative seconds per token over autoregressive ones, token-weighted."""
        return self.speculative / self.autoregressive


@dataclass(frozen=True)
class PriorConfig:
    alpha: float = 0.2  # weight of a new report in the band's average (times its tokens)
    min_sessions: int = 4  # reports before the band's average decides anything
    # The average must exceed 1 + margin to keep a band's sessions from speculating. A band mixes
    # kinds of text (docs/fallback.md#temperature-prior), and holding
    # a band back costs every session in it, while one session that speculates in vain costs
    # little (its own controller falls back): so the bar is high.
    margin: float = 0.1
    explore_every: int = 8  # of the sessions the prior holds back, every so many speculate anyway


class TemperaturePrior:
    """Per temperature band and load, how speculation measured against autoregressive decoding (see module doc)."""

    def __init__(self, config: PriorConfig = PriorConfig(), on_update=None) -> None:
        """``on_update(band, load, ratio)``: called after each report (the gateway sets its gauge)."""
        self.config = config
        self._bands: dict[tuple[str, str], _Band] = {}
        self._lock = threading.Lock()
        self._on_update = on_update

    def observe(self, temperature: float, seconds_per_token: float, step_seconds: float, tokens: int = 1,
                sessions: int = 1) -> None:
        """A session's measured speculative time per committed token against the target's step time,
        over ``tokens`` committed while speculating, with ``sessions`` in progress per target."""
        if seconds_per_token <= 0 or step_seconds <= 0 or tokens <= 0:
            return
        name, load = band(temperature), load_band(sessions)
        keep = 1 - self.config.alpha
        with self._lock:
            entry = self._bands.setdefault((name, load), _Band())
            if entry.reports == 0:
                keep = 0.0
            entry.speculative = keep * entry.speculative + (1 - keep) * seconds_per_token * tokens
            entry.autoregressive = keep * entry.autoregressive + (1 - keep) * step_seconds * tokens
            entry.reports += 1
            averaged = entry.ratio
        if self._on_update is not None:
            self._on_update(name, load, averaged)

    def ratio(self, temperature: float, sessions: int = 1) -> float | None:
        """The band's averaged ratio at that load, or None before ``min_sessions`` reports."""
        with self._lock:
            entry = self._bands.get((band(temperature), load_band(sessions)))
            return entry.ratio if entry and entry.reports >= self.config.min_sessions else None

    def holds_back(self, temperature: float, sessions: int = 1) -> bool:
        """Whether a new session at ``temperature``, with ``sessions`` in progress per target (itself
        included), should start autoregressively (and count it)."""
        ratio = self.ratio(temperature, sessions)
        if ratio is None or ratio <= 1 + self.config.margin:
            return False
        with self._lock:
            entry = self._bands[(band(temperature), load_band(sessions))]
            entry.held_back += 1
            if entry.held_back >= self.config.explore_every:
                entry.held_back = 0
                return False  # this one explores
        return True
