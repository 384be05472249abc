"""Greedy target passes with the screened LM head against the float32 one (``tandem.cpu.screened_head``).

    python benchmarks/screened_head.py                 # gemma-3-270m, 1 to 8 tokens after 100
    python benchmarks/screened_head.py --rows 1 4 --context 1000 --repeats 30

For each row count: the median time of a whole greedy engine pass (``TargetEngine.verify`` of a
block of rows-1 drafts; one row is a decode step) with the screen and without it, interleaved in
one process so the host's drift hits both alike, and their ratio. The block's cache is cut back
after every pass, so each repeat sees the same context. Both engines share the model; the tokens
they commit are compared too. Service overheads (gRPC, the draft) are left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.models import load_model
from target_service import kv_cache
from target_service.types import DraftBlock
from target_service.engine import TargetEngine
from target_service.session import SessionConfig

SESSION = "bench"


def timed_verify(engine: TargetEngine, drafts: tuple[int, ...]) -> tuple[float, tuple[int, ...]]:
    """Seconds of one greedy verify pass, and what it committed; the session is rolled back after."""
    session = engine.store.get(SESSION)
    length = len(session.tokens)
    started = time.perf_counter()
    verdict = engine.verify(DraftBlock(SESSION, length, drafts))
    seconds = time.perf_counter() - started
    del session.tokens[length:]
    kv_cache.truncate(session.cache, length - 1)
    return seconds, verdict.committed_token_ids


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m", help="target model SPEC")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8], help="tokens per pass")
    parser.add_argument("--context", type=int, default=100, help="tokens in the cache before each pass")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    loaded = load_model(args.model, device="cpu")
    screened = TargetEngine(loaded)
    if screened.runner.greedy_head is None:
        sys.exit("this model and host get no screened head (see the target's log for why)")
    plain = TargetEngine(loaded, screened_head=False)
    prompt = [(7 * i + 11) % 5000 + 100 for i in range(args.context)]
    for engine in (screened, plain):
        engine.prefill(SESSION, prompt, SessionConfig(max_new_tokens=1000, ignore_eos=True))
    greedy_next = screened.store.get(SESSION).tokens[-1]
    rows = []
    for count in args.rows:
        drafts = tuple([greedy_next] * (count - 1))
        times: dict[str, list[float]] = {"screened": [], "float32": []}
        for repeat in range(args.repeats + 1):  # the first round warms up
            took_s, committed_s = timed_verify(screened, drafts)
            took_p, committed_p = timed_verify(plain, drafts)
            if committed_s != committed_p:
                sys.exit(f"{count} rows: the screen committed {committed_s}, the float32 head {committed_p}")
            if repeat:
                times["screened"].append(took_s)
                times["float32"].append(took_p)
        row = {
            "rows": count,
            "screened_ms": statistics.median(times["screened"]) * 1e3,
            "float32_ms": statistics.median(times["float32"]) * 1e3,
        }
        row["ratio"] = row["float32_ms"] / row["screened_ms"]
        rows.append(row)
        print(
            f"{count} rows: screened {row['screened_ms']:.1f} ms, float32 {row['float32_ms']:.1f} ms "
            f"({row['ratio']:.2f}x)",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
