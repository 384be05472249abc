"""What a greedy target pass costs by the number of rows it scores, for each way of holding the weights.

    python benchmarks/pass_rows.py                              # gemma-3-270m, 1-8 rows and a 5-node tree
    python benchmarks/pass_rows.py --kernels avx2 avx512vnni --rows 1 4 8 --context 300 --json out.json
    python benchmarks/pass_rows.py --no-float32 --temperature 0 1   # greedy and sampled sessions side by side

Engines: the float32 dequantization (``--dtype float32``: oneDNN products, the screened LM head)
and the GGUF file's own blocks through each quantized kernel this host runs (``TANDEM_QUANT_KERNEL``).
For each engine and row count: the median time of ``TargetEngine.verify`` of a block of rows - 1
drafts after ``--context`` tokens of the bench prompts' text (one row is a decode step; "tree" is a
five-node token tree), all
engines interleaved in one process so the host's drift hits them alike; the cache is cut back after
every pass. Verification pays when a pass of k + 1 rows costs little more than one of a single row.
``--temperature`` gives each engine one session per temperature (sampled blocks carry a draft q on
two tokens, so their verification, acceptance and recovered-token draw are in the time).
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
from tandem.rpc.types import SparseDist
from target_service.engine import TargetEngine
from target_service.session import SessionConfig

SESSION = "bench"
SAMPLED_Q = (0.6, 0.4)  # a sampled block's q on each draft token and one other token
TREE = (-1, -1, 0, 1, 2)  # five nodes: two roots' chains, as ngram+eagle drafts for greedy sessions


def timed(engine: TargetEngine, rows: int | str, session_id: str = SESSION) -> float:
    session = engine.store.get(session_id)
    length = len(session.tokens)
    if rows == "tree":
        block = DraftBlock(session_id, length, (11, 12, 13, 14, 15), draft_parents=TREE)
    else:
        drafts = tuple(range(100, 100 + rows - 1))
        sampled = session.config.temperature > 0
        q = tuple(SparseDist((d, d + 1000), SAMPLED_Q) for d in drafts) if sampled else ()
        block = DraftBlock(session_id, length, drafts, draft_probs=q)
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
    parser.add_argument("--temperature", nargs="+", type=float, default=[0.0],
                        help="a session per temperature (0 = greedy); trees are greedy only")
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
    sessions = {t: f"{SESSION}-t{t:g}" for t in args.temperature}
    for engine in engines.values():
        for t, session_id in sessions.items():
            engine.prefill(session_id, prompt, SessionConfig(max_new_tokens=30000, ignore_eos=True, temperature=t, seed=0))
    rows = [r if r == "tree" else int(r) for r in args.rows]
    cases = [(t, count) for t in sessions for count in rows if t == 0 or count != "tree"]
    times: dict[tuple[str, float, object], list[float]] = {}
    for _ in range(args.repeats):
        for t, count in cases:
            for name, engine in engines.items():
                times.setdefault((name, t, count), []).append(timed(engine, count, sessions[t]))
    table = []
    for name in engines:
        for t in sessions:
            counts = [count for temp, count in cases if temp == t]
            one = statistics.median(times[(name, t, counts[0])])
            for count in counts:
                median = statistics.median(times[(name, t, count)])
                table.append({"engine": name, "temperature": t, "rows": count, "ms": median * 1e3, "vs_first": median / one})
                print(f"{name:<22} T={t:<4g} rows {count!s:>4}  {median * 1e3:7.1f} ms  {median / one:5.2f}x of {counts[0]} row(s)")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2) + "\n")
    return table


if __name__ == "__main__":
    main()
