"""What a greedy target pass costs by the number of rows it scores, for each way of holding the weights.

    python benchmarks/pass_rows.py                              # gemma-3-270m, 1-8 rows and a 5-node tree
    python benchmarks/pass_rows.py --kernels avx2 avx512vnni --rows 1 4 8 --context 300 --json out.json

Engines: the float32 dequantization (``--dtype float32``: oneDNN products, the screened LM head)
and the GGUF file's own blocks through each quantized kernel this host runs (``TANDEM_QUANT_KERNEL``).
For each engine and row count: the median time of ``TargetEngine.verify`` of a block of rows - 1
drafts after ``--context`` tokens of the bench prompts' text (one row is a decode step; "tree" is a
five-node token tree), all
engines interleaved in one process so the host's drift hits them alike; the cache is cut back after
every pass. Verification pays when a pass of k + 1 rows costs little more than one of a single row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.models import load_model
from tandem.quant.native import available_kernels
from target_service import kv_cache
from target_service.types import DraftBlock
from target_service.engine import TargetEngine
from target_service.session import SessionConfig

SESSION = "bench"
TREE = (-1, -1, 0, 1, 2)  # five nodes: two roots' chains, as ngram+eagle drafts for greedy sessions


def timed(engine: TargetEngine, rows: int | str) -> float:
    session = engine.store.get(SESSION)
    length = len(session.tokens)
    if rows == "tree":
        block = DraftBlock(SESSION, length, (11, 12, 13, 14, 15), draft_parents=TREE)
    else:
        block = DraftBlock(SESSION, length, tuple(range(100, 100 + rows - 1)))
    started = time.perf_counter()
    engine.verify(block)
    seconds = time.perf_counter() - started
    del session.tokens[length:]
    kv_cache.truncate(session.cache, length - 1)
    return seconds


def load_model_tokenizer(spec: str):
    from tandem.models import load_tokenizer

    return load_tokenizer(spec)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--rows", nargs="+", default=["1", "2", "3", "4", "6", "8", "tree"])
    parser.add_argument("--kernels", nargs="*", default=None, help="default: every quantized build this host runs")
    parser.add_argument("--no-float32", action="store_true", help="leave out the float32 engine")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    engines: dict[str, TargetEngine] = {}
    if not args.no_float32:
        engines["float32"] = TargetEngine(load_model(args.model, device="cpu", dtype="float32"))
    for isa in args.kernels if args.kernels is not None else available_kernels():
        os.environ["TANDEM_QUANT_KERNEL"] = isa
        engines[f"quantized {isa}"] = TargetEngine(load_model(args.model, device="cpu", dtype="auto"))
    # Real text (the bench's prompts, end to end): on a synthetic token sequence the hidden states are
    # nearly uniform and the float32 engine's screened head rescores thousands of candidates.
    from tandem.tools.bench.prompts import load_prompts

    text = "".join(p.prompt for p in load_prompts(None, 0))
    ids = load_model_tokenizer(args.model)(text).input_ids
    prompt = (ids * (args.context // len(ids) + 1))[: args.context]
    for engine in engines.values():
        engine.prefill(SESSION, prompt, SessionConfig(max_new_tokens=30000, ignore_eos=True))
    rows = [r if r == "tree" else int(r) for r in args.rows]
    times: dict[tuple[str, object], list[float]] = {}
    for _ in range(args.repeats):
        for count in rows:
            for name, engine in engines.items():
                times.setdefault((name, count), []).append(timed(engine, count))
    table = []
    for name in engines:
        one = statistics.median(times[(name, rows[0])])
        for count in rows:
            median = statistics.median(times[(name, count)])
            table.append({"engine": name, "rows": count, "ms": median * 1e3, "vs_first": median / one})
            print(f"{name:<22} rows {count!s:>4}  {median * 1e3:7.1f} ms  {median / one:5.2f}x of {rows[0]} row(s)")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2) + "\n")
    return table


if __name__ == "__main__":
    main()
