"""What a shared target pass costs against one pass per session (``target_service.ragged``).

    python benchmarks/batched_passes.py                      # gemma-3-270m, the table below
    python benchmarks/batched_passes.py --sessions 2 8 --rows 1 3 --context 1000

For each (sessions, rows per session): the median time of one batched forward pass over that many
sessions, each feeding ``rows`` tokens after a prompt of ``--context`` tokens, against the same
sessions run one pass each (``ModelRunner.forward``), and the ratio (throughput gain). Caches are
cut back after every pass, so every repeat sees the same context. In-process, the model only: no
gRPC, no sampling. On the 2-core CPU, gemma-3-270m, context 121 (one run): 4 x 1 rows 39.8 ms against 142 ms
(3.6x), 16 x 2 rows 206 ms against 581 ms (2.8x), 16 x 4 rows 313 ms against 618 ms (2.0x).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.models import load_model
from target_service import kv_cache, ragged
from target_service.engine import TargetEngine
from target_service.session import SessionConfig


def measure(engine: TargetEngine, sessions: int, rows: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one batched pass and of the same sessions' separate passes."""
    live = [engine.store.get(f"s{i}") for i in range(sessions)]
    lengths = [kv_cache.cache_length(session.cache) for session in live]
    tokens = [[5] * rows for _ in live]

    def restore() -> None:
        for session, length in zip(live, lengths):
            kv_cache.truncate(session.cache, length)

    batched, separate = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        with torch.inference_mode():
            ragged.forward(engine.runner.model, [s.cache for s in live], tokens, engine.device)
        batched.append(time.perf_counter() - started)
        restore()
        started = time.perf_counter()
        for session, ids in zip(live, tokens):
            engine.runner.forward(session, ids)
        separate.append(time.perf_counter() - started)
        restore()
    return statistics.median(batched), statistics.median(separate)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m", help="target model SPEC")
    parser.add_argument("--sessions", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="tokens per session and pass")
    parser.add_argument("--context", type=int, default=121, help="prompt tokens in each session's cache")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = TargetEngine(load_model(args.model, "cpu", "auto"))
    prompt = [(7 * i) % 200 + 5 for i in range(args.context)]
    for i in range(max(args.sessions)):
        engine.prefill(f"s{i}", prompt, SessionConfig(max_new_tokens=max(args.rows) + 2))
    results = []
    print(f"{args.model}, context {args.context}, {torch.get_num_threads()} threads")
    print(f"{'sessions':>8} {'rows':>4} {'batched':>10} {'separate':>10} {'gain':>6}")
    for rows in args.rows:
        for sessions in args.sessions:
            batched, separate = measure(engine, sessions, rows, args.repeats)
            results.append({"sessions": sessions, "rows": rows, "batched_s": batched, "separate_s": separate})
            print(
                f"{sessions:>8} {rows:>4} {batched * 1e3:>8.1f}ms {separate * 1e3:>8.1f}ms {separate / batched:>5.2f}x"
            )
    return results


if __name__ == "__main__":
    main()
