"""``python -m tandem.rpc.healthcheck ADDRESS [--service NAME] [--timeout S]``: a gRPC health probe.

Asks ``grpc.health.v1.Health/Check`` at ADDRESS and exits 0 when the answer is SERVING, 1 otherwise
(NOT_SERVING, unknown service, unreachable, timeout), printing the status. It is what the compose
healthchecks run inside each container, so an image needs no separate probe binary.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    """(serving, what was seen) for one Check call."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as error:
            return False, f"{error.code().name}: {error.details() or ''}".rstrip(": ")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.rpc.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of a tandem gRPC server")
    parser.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    serving, seen = check(args.address, args.service, args.timeout)
    print(f"{args.address}: {seen}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
