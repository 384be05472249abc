"""Why the engine refuses a request. Plain exceptions, so the engine knows nothing of gRPC;
``server.py`` maps each to a status code (the name says which)."""

from __future__ import annotations


class TargetError(Exception):
    """Base of every refusal; the message is shown to the caller as is."""


class InvalidArgument(TargetError):
    """Malformed request: empty ids, tokens outside the vocabulary, bad sampling parameters."""


class SessionNotFound(TargetError):
    """No session of that id (never created, released, or expired)."""


class SessionExists(TargetError):
    """Prefill with the id of a session that is still held."""


class TooManySessions(TargetError):
    """``max_sessions`` live sessions are held already, or their KV cache reservations fill the
    budget (gRPC RESOURCE_EXHAUSTED)."""


class TokenizerMismatch(TargetError):
    """The caller tokenizes differently from the target (gRPC FAILED_PRECONDITION)."""
