"""What the sessions in progress are doing, counted in one place that all generations share.

Every generation reports here what happened to it (a session started, switched mode, fell back, a
Prefill started or finished, a draft answered) instead of each one bumping fields on the shared
:class:`gateway.deps.GenerationDeps`. The readers are the speculation policy (how many sessions
run: its saturation rule), the stall rule of the draft's Speculate streams
(:meth:`SessionCounters.draft_silence_explained`), the ``tandem_sessions_active`` and
``tandem_session_fallbacks_total`` metrics, and the tests.

Invariant: ``active_sessions`` equals the sum of the ``tandem_sessions_active`` gauge over its
modes, since both move only together, in :meth:`started`, :meth:`switched` and :meth:`ended`.
"""

from __future__ import annotations

from gateway.policy import Mode
from tandem.telemetry.metrics import Metrics


class SessionCounters:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._active_sessions = 0
        self._prefills_in_flight = 0
        # When (time.monotonic) any Speculate stream last delivered a message and a Prefill last
        # finished: what tells a draft waiting behind a busy target from a stalled one.
        self._last_draft_message = -float("inf")
        self._last_prefill_done = -float("inf")

    @property
    def active_sessions(self) -> int:
        """Sessions in progress (the saturation rule of the policy counts them)."""
        return self._active_sessions

    @property
    def prefills_in_flight(self) -> int:
        return self._prefills_in_flight

    # -- sessions --------------------------------------------------------------------------------

    def started(self, mode: Mode) -> None:
        """A session entered its first mode."""
        self._active_sessions += 1
        self._metrics.sessions_active.labels(mode=mode.value).inc()

    def switched(self, old: Mode, new: Mode) -> None:
        """A session in progress moved from ``old`` to ``new`` (which may be the same mode)."""
        self._metrics.sessions_active.labels(mode=old.value).dec()
        self._metrics.sessions_active.labels(mode=new.value).inc()

    def fell_back(self, reason: str) -> None:
        """A session decodes autoregressively for ``reason`` (the client's ``speculation: "off"``
        included, under its own reason)."""
        self._metrics.session_fallbacks.labels(reason=reason).inc()

    def ended(self, mode: Mode) -> None:
        """A session that had entered a mode (last ``mode``) is over."""
        self._metrics.sessions_active.labels(mode=mode.value).dec()
        self._active_sessions -= 1

    # -- what a silent draft may be waiting for --------------------------------------------------

    def prefill_started(self) -> None:
        """A Prefill call went out (a long prefill holds up every draft's next round)."""
        self._prefills_in_flight += 1

    def prefill_finished(self, now: float) -> None:
        """A Prefill call ended, whichever way."""
        self._prefills_in_flight -= 1
        self._last_prefill_done = now

    def draft_answered(self, now: float) -> None:
        """A Speculate stream delivered a message."""
        self._last_draft_message = now

    def draft_silence_explained(self, now: float, deadline_s: float) -> bool:
        """Whether a silent Speculate stream is waiting behind other work at the target rather
        than on a stalled draft.

        The target runs one pass at a time, so one session's round waits behind a pass of every
        other session and behind any prefill: seconds of silence from a healthy draft under load.
        Calling that a stall would open the breaker, blame the draft in the
        logs and move each session to a fresh target session (one more prefill each) just when the
        target is busiest. So the silence is explained while the draft keeps delivering rounds to
        other sessions, or while prefills run (and for ``deadline_s`` after the last one: the
        rounds queued behind them come next); a stalled draft delivers nothing to anyone.
        """
        last_progress = max(self._last_draft_message, self._last_prefill_done)
        return self._prefills_in_flight > 0 or now - last_progress < deadline_s
