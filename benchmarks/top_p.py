"""What a top-p cut costs a sampled row on a CPU: buckets, the window of the largest logits, a sort.

    python benchmarks/top_p.py                      # 262,144 ids (gemma-3's vocabulary)
    python benchmarks/top_p.py --vocab 128256 --repeats 15

Rows of three shapes (logits ``randn * scale``: 1 is flat, a top-p set of ~10^5 tokens; 6 is
peaked, tens of tokens), for each top_p: the median time of each way, interleaved in one process,
how many tokens the sort keeps, and whether the buckets keep the same ones (they may differ only
where a token's exact mass lies within float32 rounding of top_p; the sort sums float32
probabilities). The window answers None where it cannot decide (then the sort ran). See
``kernels/reference/sampling.py`` and docs/sampling.md#top-p-without-a-sort.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.reference import sampling


def timed(fn) -> tuple[float, torch.Tensor | None]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 3.0, 6.0])
    parser.add_argument("--top-p", type=float, nargs="+", default=[0.9, 0.95])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    no_k, truncate = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool)
    print(f"{'scale':>5} {'top_p':>5} {'kept':>7} {'sort ms':>8} {'window ms':>10} {'buckets ms':>11}  same set")
    for scale in args.scales:
        row = torch.randn(1, 1, args.vocab, generator=generator) * scale  # [1, 1, vocab]
        for top_p in args.top_p:
            p = torch.tensor([top_p])
            ways = {
                "sort": partial(sampling._sorted_truncation, row, p, no_k, truncate),
                "window": partial(sampling._windowed_truncation, row, p, no_k, truncate),
                "buckets": partial(sampling._bucketed_top_p, row, p),
            }
            times: dict[str, list[float]] = {name: [] for name in ways}
            outs: dict[str, torch.Tensor | None] = {}
            for _ in range(args.repeats + 1):  # the first round warms up
                for name, way in ways.items():
                    seconds, outs[name] = timed(way)
                    times[name].append(seconds)
            ms = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
            kept = outs["sort"] > 0
            window = f"{ms['window']:.2f}" + ("" if outs["window"] is not None else " (none)")
            print(f"{scale:>5g} {top_p:>5g} {int(kept.sum()):>7} {ms['sort']:>8.2f} {window:>10} {ms['buckets']:>11.2f}  "
                  f"{bool(torch.equal(outs['buckets'] > 0, kept))}")


if __name__ == "__main__":
    main()
