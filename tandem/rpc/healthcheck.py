"""``python -m tandem.rpc.healthcheck ADDRESS [--service NAME] [--timeout S] [--tls-ca FILE ...]``: a gRPC health probe.

Asks ``grpc.health.v1.Health/Check`` at ADDRESS and exits 0 when the answer is SERVING, 1 otherwise
(NOT_SERVING, unknown service, unreachable, timeout), printing the status. It is what the compose
healthchecks run inside each container, so an image needs no separate probe binary. It dials with
TLS when given a CA or a certificate; the flags default to the container's own ``TANDEM_TLS_*``
settings, so a probe of a mutual-TLS service presents the service's own certificate.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.rpc.security import PLAINTEXT, HopSecurity, SecurityError


def check(address: str, service: str = "", timeout_s: float = 3.0, security: HopSecurity = PLAINTEXT
          ) -> tuple[bool, str]:
    """(serving, what was seen) for one Check call."""
    with security.sync_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as error:
            seen = f"{error.code().name}: {error.details() or ''}".rstrip(": ")
            if error.code() == grpc.StatusCode.UNAVAILABLE and not security.dials_tls:
                seen += " (if the server uses TLS, pass --tls-ca, and --tls-cert/--tls-key for mutual TLS)"
            return False, seen
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.rpc.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of a tandem gRPC server")
    parser.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    env = os.environ.get
    parser.add_argument("--tls-ca", default=env("TANDEM_TLS_CA"), help="CA the server's certificate is checked "
                        "against (env TANDEM_TLS_CA)")
    parser.add_argument("--tls-cert", default=env("TANDEM_TLS_CERT"), help="client certificate (env TANDEM_TLS_CERT)")
    parser.add_argument("--tls-key", default=env("TANDEM_TLS_KEY"), help="its key (env TANDEM_TLS_KEY)")
    parser.add_argument("--tls-server-name", default=env("TANDEM_TLS_SERVER_NAME"),
                        help="the name the server's certificate is issued to, if not the address's host")
    args = parser.parse_args(argv)
    try:
        security = HopSecurity.from_settings(argparse.Namespace(**vars(args), internal_token="", insecure=False))
    except SecurityError as exc:
        parser.error(str(exc))
    serving, seen = check(args.address, args.service, args.timeout, security)
    print(f"{args.address}: {seen}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
