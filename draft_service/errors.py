"""Errors the draft service raises; ``server.py`` maps each to one gRPC status code."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A Speculate request that can never succeed (INVALID_ARGUMENT)."""


class UnknownTargetError(InvalidRequestError):
    """A Speculate request naming a target the draft was not started with (INVALID_ARGUMENT): the
    draft connects only to its configured pool, never to an address a caller makes up."""


class TokenizerMismatchError(RuntimeError):
    """Draft and target (or caller) tokenizers differ: token ids would mean different text.

    At start-up it stops the service; per session it is FAILED_PRECONDITION.
    """


class SessionBusyError(RuntimeError):
    """A second Speculate for a session that already has a loop running (ALREADY_EXISTS)."""


class DivergedError(RuntimeError):
    """The target refused blocks as stale in a way the draft cannot repair (ABORTED).

    Nothing uncommitted was ever streamed, so the caller can continue the session with the
    target's Generate without losing or duplicating tokens.
    """


class ProtocolError(RuntimeError):
    """The target answered something that breaks the Verify contract (INTERNAL)."""


class TargetUnavailableError(RuntimeError):
    """No target of the pool became SERVING in time (start-up only)."""


class IncompatibleDraftError(RuntimeError):
    """A draft that cannot serve this target (an eagle head trained for another target); start-up only."""
