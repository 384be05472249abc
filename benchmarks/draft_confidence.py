"""Where a drafter can agree with the target: positions by the target's own confidence, per domain.

    python benchmarks/draft_confidence.py [--head DIR] [--cache FILE]

For every position of the target's greedy continuations of the bench prompts (the cache
``benchmarks/draft_replay.py`` keeps: tokens and final hidden states), it reads the target's
probability of its own next token (``p_max``) and asks two drafters for that token, each given what
it has live right after a verdict:

- the eagle head, one step from the target's true feature at t and the token at t + 1 (its first
  draft of a round): does its top-1 (top-4) hold the target's token at t + 2;
- copying from context: the token that followed the latest earlier occurrence of the text's last
  1-4 tokens (the longest found). This is what any lookup drafter can copy, not the shipped one's
  rules.

A domain whose positions are mostly confident and copyable speculates well; one whose positions are
low-confidence (a continuation the target itself barely prefers) leaves any small drafter guessing
among near-ties. The table says which, per domain and confidence band.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))

from draft_replay import greedy_runs  # noqa: E402
from tandem.models import load_model, resolve  # noqa: E402
from tandem.models.eagle import EagleDrafter, builtin_head_dir, load_head, load_target_tensors  # noqa: E402
from tandem.tools.bench.prompts import load_prompts  # noqa: E402

BANDS = (0.0, 0.5, 0.9, 1.01)  # p_max bands: near-ties, leaning, confident
COPY_MAX = 4  # the longest suffix copying looks for


def copied(seq: list[int]) -> int | None:
    """The token after the latest earlier occurrence of seq's longest suffix (COPY_MAX..1 tokens)."""
    for n in range(min(COPY_MAX, len(seq) - 1), 0, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                return seq[start + n]
    return None


def band(p_max: float) -> str:
    i = next(i for i in range(len(BANDS) - 1) if BANDS[i] <= p_max < BANDS[i + 1])
    return f"p_max {BANDS[i]:.1f}-{min(BANDS[i + 1], 1.0):.1f}"


def tally(runs: list[dict], drafter: EagleDrafter, embed: torch.Tensor,
          softcap: float | None = None) -> dict[str, dict[str, Counter]]:
    """domain -> band (and "all") -> counts of positions, head top-1 / top-4 hits, copy hits.
    ``embed`` [vocab, hidden]: the target's LM head (tied to its embedding); ``softcap``: its
    final logit soft-capping."""
    out: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    vocab_ids = drafter.vocab_ids  # [reduced] reduced index -> target id
    with torch.inference_mode():
        for run in runs:
            ids, hidden, start = run["ids"], run["hidden"].float(), run["prompt_len"]  # hidden [seq, h]
            logits = hidden @ embed.T  # [seq, vocab]: position t's next-token logits
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            probs = torch.softmax(logits, dim=-1)  # [seq, vocab]
            # The head's first draft from position t: (feature t, token t+1) -> token t+2.
            positions = range(start - 1, len(ids) - 2)
            if not positions:
                continue
            rows = torch.tensor(list(positions))
            _, guesses = drafter.step(hidden[rows], torch.tensor([ids[t + 1] for t in positions]))  # [n, reduced]
            top4 = vocab_ids[guesses.topk(4, dim=-1).indices]  # [n, 4] target ids
            for i, t in enumerate(positions):
                target = ids[t + 2]
                p = probs[t + 1]
                if int(p.argmax()) != target:  # the cached text is the served model's; skip where these differ
                    continue
                for key in (band(float(p.max())), "all"):
                    c = out[run["domain"]][key]
                    c["positions"] += 1
                    c["head_top1"] += int(top4[i, 0]) == target
                    c["head_top4"] += bool((top4[i] == target).any())
                    c["copy"] += copied(ids[: t + 2]) == target
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-model", default="gemma-3-270m")
    parser.add_argument("--head", type=Path, default=None, help="an eagle head folder (default: the shipped one)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/tandem-draft-replay.pt"),
                        help="draft_replay.py's cache of greedy continuations (made when missing)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    loaded = load_model(args.target_model, device="cpu", dtype="auto")
    runs = greedy_runs(loaded, load_prompts(None), args.max_tokens, args.cache)
    head_dir = args.head or builtin_head_dir(loaded.name)
    if head_dir is None:
        parser.error(f"no head ships for {loaded.name}: give --head")
    head, vocab_ids = load_head(head_dir)
    if head.config.head_tensor != head.config.embed_tensor:
        parser.error("the target's LM head is not its embedding: this script reads the target's distribution "
                     "through a tied head only")
    target = load_target_tensors(resolve(args.target_model).hf_dir, head.config, vocab_ids)
    drafter = EagleDrafter(head, vocab_ids, target, dtype=torch.float32)
    counts = tally(runs, drafter, target.embed.float(), head.config.logit_softcap)  # embed [vocab, h]

    table = {}
    for domain in sorted(counts):
        whole = counts[domain]["all"]["positions"]
        for key in ["all", *sorted(k for k in counts[domain] if k != "all")]:
            c = counts[domain][key]
            n = c["positions"]
            row = {"positions": n, "share": n / whole, **{k: c[k] / n for k in ("head_top1", "head_top4", "copy")}}
            table[f"{domain} {key}"] = row
            print(f"{domain:6s} {key:13s} {n:4d} positions ({row['share']:4.0%})  head top-1 {row['head_top1']:.2f}"
                  f"  top-4 {row['head_top4']:.2f}  copy {row['copy']:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
