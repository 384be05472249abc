"""How every tandem gRPC hop is secured: TLS, mutual TLS, the internal token, and no plaintext
beyond loopback.

One :class:`HopSecurity` per process, made from its settings (``--tls-cert``, ``--tls-key``,
``--tls-ca``, ``--tls-server-name``, ``--internal-token``, ``--insecure``), serves both sides of a
hop:

* as a server it binds a TLS port when it has a certificate and key, and with a CA as well it
  requires client certificates signed by that CA (mutual TLS); with a token, the
  :class:`InternalTokenInterceptor` refuses calls to the service's methods that do not carry it;
* as a client it verifies the server's certificate against the CA (the system's roots without
  one), presents its own certificate when it has one, and sends the token with every call.

Health checks and reflection stay open to token-less callers (probes need no secret), but not to
callers without a client certificate under mutual TLS: the TLS handshake comes before any method.

Invariant: a server listens in plaintext on a non-loopback address only when ``--insecure`` says
so (:func:`check_exposure`); whoever can reach such a port can call every method.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

#: The metadata key the internal token travels under (``authorization`` is the gateway's API keys').
TOKEN_KEY = "tandem-internal-token"


class SecurityError(ValueError):
    """Settings that cannot secure a hop: a missing file, half a key pair, plaintext on a network."""


def _read(flag: str, path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"{flag}: cannot read {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class HopSecurity:
    """PEM bytes of this process's certificate chain, its key and the CA that signs its peers."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    server_name: str | None = None  # the name upstream certificates are checked against, if not the address's
    token: str = field(default="", repr=False)
    insecure: bool = False

    @classmethod
    def from_settings(cls, settings: Any) -> HopSecurity:
        """From a service's settings; SecurityError names the flag of a file that cannot be read
        or of a certificate without its key."""
        cert = _read("--tls-cert", settings.tls_cert)
        key = _read("--tls-key", settings.tls_key)
        if (cert is None) != (key is None):
            raise SecurityError("--tls-cert and --tls-key go together: give both or neither")
        return cls(cert, key, _read("--tls-ca", settings.tls_ca), settings.tls_server_name or None,
                   settings.internal_token.strip(), settings.insecure)

    @property
    def serves_tls(self) -> bool:
        return self.cert is not None

    @property
    def mutual(self) -> bool:
        return self.serves_tls and self.ca is not None

    @property
    def dials_tls(self) -> bool:
        """Whether this process's clients use TLS: with a CA to check servers or a certificate to show."""
        return self.ca is not None or self.cert is not None

    def describe(self) -> str:
        """For the start-up log line: which protection a server has."""
        parts = ["mutual TLS" if self.mutual else "TLS" if self.serves_tls else "plaintext"]
        return " + ".join([*parts, "internal token"] if self.token else parts)

    # -- server side --------------------------------------------------------------------------

    def server_credentials(self, client_certs: bool = True) -> grpc.ServerCredentials | None:
        """None without a certificate; with a CA (and ``client_certs``), client certificates are required."""
        if self.cert is None or self.key is None:
            return None
        require = client_certs and self.ca is not None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca if require else None,
                                           require_client_auth=require)

    def interceptors(self, service: str) -> list[grpc.aio.ServerInterceptor]:
        return [InternalTokenInterceptor(self.token, service)] if self.token else []

    # -- client side --------------------------------------------------------------------------

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call to another tandem service carries besides its own metadata."""
        return ((TOKEN_KEY, self.token),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.dials_tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def name_options(self, server_name: str | None) -> list[tuple[str, str]]:
        """Channel options that check the server's certificate against ``--tls-server-name`` or the
        name the address was found under (a pool member dialled by IP has its DNS name's certificate)."""
        name = self.server_name or server_name
        if not self.dials_tls or not name:
            return []
        return [("grpc.ssl_target_name_override", name), ("grpc.default_authority", name)]

    def aio_channel(self, address: str, options: Iterable[tuple[str, Any]], server_name: str | None = None
                    ) -> grpc.aio.Channel:
        options = [*options, *self.name_options(server_name)]
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, credentials, options=options)

    def sync_channel(self, address: str, server_name: str | None = None) -> grpc.Channel:
        options = self.name_options(server_name)
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, credentials, options=options)


PLAINTEXT = HopSecurity()


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, or "" / "0.0.0.0" (every interface)


def check_exposure(service: str, host: str, protected: bool, insecure: bool) -> None:
    """Refuses to serve in plaintext (``protected`` False) on a non-loopback ``host`` unless
    ``insecure``; with ``insecure`` it warns (once per service start). ``service``: what the
    message names ("the target", "tandem serve's services")."""
    if protected or is_loopback(host):
        return
    if not insecure:
        raise SecurityError(
            f"{service} would serve plaintext on {host}, which other machines can reach: give it --tls-cert "
            f"and --tls-key (and --tls-ca for mutual TLS), bind --host 127.0.0.1, or pass --insecure to serve "
            f"without TLS on a network you trust"
        )
    log.warning("%s serves plaintext on %s (--insecure): anyone who can reach the port can call it and read "
                "its traffic", service, host)


# -- the internal token ---------------------------------------------------------------------------


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to ``service``'s methods without the token (``UNAUTHENTICATED``), compared in
    constant time; other services on the server (health, reflection) stay open."""

    def __init__(self, token: str, service: str) -> None:
        self._token = token.encode()
        self._prefix = f"/{service}/"

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        given = str(dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")).encode()
        if hmac.compare_digest(given, self._token):
            return handler
        why = "without the internal token" if not given else "with a wrong internal token"
        return refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                        f"{details.method} called {why}: this service requires the --internal-token its peers "
                        f"were given (metadata {TOKEN_KEY})")


def refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with ``code`` and ``message``."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    shape = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    make: Callable[..., grpc.RpcMethodHandler]
    if handler.request_streaming:
        make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else \
            grpc.stream_unary_rpc_method_handler
    else:
        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else \
            grpc.unary_unary_rpc_method_handler
    return make(refuse, **shape)


def for_service(settings: Any, service: str, other_ports_tls: bool = True, what: str = "") -> HopSecurity:
    """The security of ``tandem <service>``'s settings, refused with a one-line SystemExit when a
    file cannot be read or it would serve plaintext beyond loopback. Its gRPC port has TLS with a
    certificate; ``other_ports_tls``: whether the rest it serves has too (the gateway's HTTP).
    ``what``: how messages name it, by default "the <service>"."""
    what = what or f"the {service}"
    try:
        security = HopSecurity.from_settings(settings)
        if security.ca is not None and not security.serves_tls:
            log.warning("--tls-ca without --tls-cert/--tls-key: %s checks the servers it calls but serves "
                        "plaintext itself", what)
        check_exposure(what, settings.host, security.serves_tls and other_ports_tls, settings.insecure)
    except SecurityError as exc:
        raise SystemExit(f"tandem {service}: error: {exc}") from None
    return security
