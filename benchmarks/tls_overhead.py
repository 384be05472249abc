"""What mutual TLS and the internal token cost per hop: the same target served on a plaintext
port and on a mutual-TLS port (one server, both ports), calls interleaved.

Two figures, as ratios in one run: the round trip of a call that does no model work (health
Check: the hop itself), and a Verify round without drafts on a real session of the model (a pass
of one row: the cheapest round a session pays, so the share TLS takes of it is the largest). Certificates are made for the run with
``cryptography`` (a CA and one leaf, as ``deploy/tls/make-certs.sh`` makes them).

    python benchmarks/tls_overhead.py --target-model gemma-3-270m --rounds 40 --calls 2000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# tests/ instead of this script's folder at the head of the path: benchmarks/kernels.py would hide
# the kernels package.
sys.path[0] = str(Path(__file__).resolve().parent.parent / "tests")
from certs import CA

from tandem.models import load_model
from tandem.rpc.endpoints import CHANNEL_OPTIONS
from tandem.rpc.security import HopSecurity
from tandem.telemetry.metrics import make_metrics
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine
from target_service.main import start_target

PROMPT = "Speculative decoding verifies a block of drafted tokens in one pass of the target model, so"


def security(folder: Path, token: str) -> tuple[HopSecurity, HopSecurity]:
    ca = CA(folder)
    pair = ca.issue("target")
    read = HopSecurity(cert=pair.cert.read_bytes(), key=pair.key.read_bytes(), ca=ca.pem.read_bytes(), token=token)
    return read, read  # the server and its caller share the one certificate, as make-certs.sh's do


async def health_round_trips(channel: grpc.aio.Channel, calls: int) -> list[float]:
    stub = health_pb2_grpc.HealthStub(channel)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        await stub.Check(health_pb2.HealthCheckRequest())
        times.append(time.perf_counter() - started)
    return times


async def verify_rounds(channel: grpc.aio.Channel, auth, tokens: list[int], rounds: int, tag: str) -> list[float]:
    """One session of ``rounds`` blocks without drafts: the floor of a round, a pass of one row."""
    stub = target_pb2_grpc.TargetServiceStub(channel)
    session_id = f"bench-{tag}-{time.monotonic_ns()}"
    params = common_pb2.SessionParams(max_new_tokens=rounds + 2, ignore_eos=True)
    first = await stub.Prefill(target_pb2.PrefillRequest(session_id=session_id, prompt_token_ids=tokens,
                                                         params=params), metadata=auth)
    committed = [*tokens, first.token_id]
    call = stub.Verify(metadata=auth)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        await call.write(target_pb2.VerifyRequest(session_id=session_id, base_len=len(committed)))
        verdict = await call.read()
        committed += list(verdict.committed_token_ids)
        times.append(time.perf_counter() - started)
    await call.done_writing()
    await stub.Release(target_pb2.ReleaseRequest(session_id=session_id), metadata=auth)
    return times


async def main(args: argparse.Namespace) -> None:
    loaded = load_model(args.target_model, device="cpu", dtype=args.dtype)
    tokens = loaded.tokenizer(PROMPT)["input_ids"]
    engine = TargetEngine(loaded, metrics=make_metrics("target"))
    with tempfile.TemporaryDirectory() as folder:
        server_side, client_side = security(Path(folder), "bench-token")
        # Two servers over the one engine (a grpc.aio server's ports are fixed before it starts):
        # calls are never concurrent here, so the engine sees one pass at a time as it would.
        secured = await start_target(engine, security=server_side)
        plain = await start_target(engine)
        channels = {
            "plaintext": (grpc.aio.insecure_channel(f"127.0.0.1:{plain.port}", options=CHANNEL_OPTIONS), ()),
            "mutual TLS + token": (client_side.aio_channel(f"localhost:{secured.port}", CHANNEL_OPTIONS),
                                   client_side.call_metadata),
        }
        hop: dict[str, list[float]] = {name: [] for name in channels}
        rounds: dict[str, list[float]] = {name: [] for name in channels}
        for channel, _ in channels.values():  # warm both up (the handshake, the first pass)
            await health_round_trips(channel, 20)
        for repeat in range(args.repeats):  # interleaved
            for name, (channel, auth) in channels.items():
                hop[name] += await health_round_trips(channel, args.calls // args.repeats)
                rounds[name] += await verify_rounds(channel, auth, tokens, args.rounds // args.repeats, f"{repeat}")
        print(f"{'hop':<22} {'health Check p50 (us)':>22} {'Verify round p50 (ms)':>22}")
        for name in channels:
            print(f"{name:<22} {statistics.median(hop[name]) * 1e6:>22.0f} "
                  f"{statistics.median(rounds[name]) * 1e3:>22.2f}")
        base, tls = [statistics.median(hop[name]) for name in channels]
        base_round, tls_round = [statistics.median(rounds[name]) for name in channels]
        print(f"TLS / plaintext: hop {tls / base:.2f}x, Verify round {tls_round / base_round:.3f}x")
        for channel, _ in channels.values():
            await channel.close()
        await plain.stop(0)
        await secured.stop(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-model", default="gemma-3-270m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=4, help="interleaved passes over both hops")
    asyncio.run(main(parser.parse_args()))
