"""Per-session choice between speculative and plain autoregressive decoding.

This is the seam for the adaptive policy of a later issue (switching on low acceptance, high
temperature or saturation). For now the rule is static: ``"off"`` decodes autoregressively,
``"on"`` speculates or fails, and ``"auto"`` speculates unless the draft service is unavailable,
in which case the session falls back to the target's ``Generate`` (counted as a fallback with
reason ``draft_unavailable``) instead of failing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gateway.request import Speculation

DRAFT_UNAVAILABLE = "draft_unavailable"


class Mode(str, enum.Enum):
    """How a session is being decoded right now (the ``mode`` label of tandem_sessions_active)."""

    SPECULATIVE = "speculative"
    AUTOREGRESSIVE = "autoregressive"


@dataclass(frozen=True)
class Decision:
    mode: Mode
    # Set when the policy chose autoregressive decoding against the client's "auto" preference.
    fallback_reason: str | None = None


class SpeculationPolicy:
    def initial(self, requested: Speculation, draft_ready: bool) -> Decision:
        """The mode a session starts in. ``draft_ready`` is the health monitor's last word on the draft."""
        if requested is Speculation.OFF:
            return Decision(Mode.AUTOREGRESSIVE)
        if requested is Speculation.AUTO and not draft_ready:
            return Decision(Mode.AUTOREGRESSIVE, DRAFT_UNAVAILABLE)
        return Decision(Mode.SPECULATIVE)

    def on_draft_unavailable(self, requested: Speculation) -> Decision | None:
        """What to do when the draft cannot be reached mid-session; None means fail the request."""
        if requested is Speculation.AUTO:
            return Decision(Mode.AUTOREGRESSIVE, DRAFT_UNAVAILABLE)
        return None
