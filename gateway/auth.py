"""API keys: who may use the gateway.

With keys configured (``--api-key``, ``TANDEM_API_KEYS``, ``--api-key-file``), every HTTP route but
``/health`` (and ``/metrics``, unless ``--metrics-auth``) and both ``tandem.v1.GatewayService``
methods require one: ``Authorization: Bearer KEY`` over HTTP (as the OpenAI SDKs send their
``api_key``), the ``authorization`` metadata (same value) over gRPC. Health checks stay open so
that probes need no secret.

A key is compared with every configured key in constant time (:func:`hmac.compare_digest`), so the
time a refusal takes says nothing about how close a guess was. Keys never reach logs, traces or
metrics: a key is known there by its id, the first 8 hex digits of its SHA-256.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from gateway.errors import Unauthenticated
from tandem.rpc.security import refusing


def key_id(key: str) -> str:
    """A name for a key that reveals nothing usable about it."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [key.encode() for key in dict.fromkeys(k.strip() for k in keys) if key]

    @classmethod
    def load(cls, keys: str = "", key_file: str | None = None) -> ApiKeys:
        """``keys`` comma-separated, ``key_file`` one per line (blank lines and ``#`` comments
        skipped); OSError when the file cannot be read."""
        found = keys.split(",")
        if key_file:
            lines = Path(key_file).read_text().splitlines()
            found += [line for line in lines if not line.lstrip().startswith("#")]
        return cls(found)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, authorization: str | None) -> str | None:
        """The id of the key ``authorization`` ("Bearer KEY") carries; None when no keys are
        configured. Raises :class:`Unauthenticated` for a missing or unknown key."""
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("this server requires an API key: send it as 'Authorization: Bearer KEY'")
        given = token.strip().encode()
        matched = False
        for key in self._keys:  # every key compared, whichever matches
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise Unauthenticated(f"the API key {key_id(given.decode(errors='replace'))} (key id) is not valid")
        return key_id(given.decode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to ``service``'s methods without a valid key (``UNAUTHENTICATED``); other
    services on the server (health, reflection) stay open."""

    def __init__(self, keys: ApiKeys, service: str, on_refusal: Callable[[], None] = lambda: None) -> None:
        self._keys = keys
        self._prefix = f"/{service}/"
        self._on_refusal = on_refusal

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not self._keys.enabled or not details.method.startswith(self._prefix):
            return handler
        metadata = dict(details.invocation_metadata or ())
        try:
            self._keys.check(metadata.get("authorization"))
        except Unauthenticated as exc:
            self._on_refusal()
            return refusing(handler, grpc.StatusCode.UNAUTHENTICATED, exc.message)
        return handler
