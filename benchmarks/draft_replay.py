"""Replays drafters offline on the target's greedy outputs, priced with measured CPU costs.

    python benchmarks/draft_replay.py --drafts ngram eagle ngram+eagle -k 3

``tandem bench`` measures a whole stack, one drafter per run, in minutes. This answers "which
drafter, which K" in about one: the target generates each bench prompt's greedy continuation
once (cached in ``--cache``) along with its final hidden states, then every drafter's real
proposer session is replayed against it in-process: propose, accept the longest prefix equal to
the target's tokens, commit what a verdict would commit (with the hidden-state rows a verdict
carries). Greedy verification is deterministic, so the rounds are exactly the live ones. A token
tree (``--draft-setting draft_tree_nodes=N``) accepts its longest root path equal to the target's
tokens, and a round over its N nodes is priced as a pass over N + 1 tokens; whether a round drafts a
tree or a chain is chosen from the modelled rates as live (``--draft-setting draft_trees=always``:
trees wherever they can be drafted). With ``--cut on`` the block-length policy cuts trees to their
first nodes and learns from their verdicts as it does from chains'.

Time is modelled, not measured end to end: a round costs the measured target pass over its
1 + k tokens (median of several, on a context of the prompt's size), plus the drafter's own
measured propose time. Autoregressive decoding costs one single-token pass per token; both
start with the same measured prefill. On the bench prompts this matched ``tandem bench`` within
a few percent (ngram, K=3: 1.65x modelled, 1.65x measured). Service overheads (gRPC, the
gateway) are left out, so live numbers are a little lower for both modes.

Proposals are timed the way the draft service runs them: on ``--draft-threads`` torch threads
(the service's default is 1) and, unless ``--flush-mb 0``, right after writing a buffer larger
than the CPU's last-level cache, because live every proposal follows a target pass that has
streamed the target's weights through that cache. Without the flush an eagle head's steps
measured about 2x cheaper than they are live.

``--draft-setting NAME=VALUE`` (repeatable) sets a DraftSettings field for every drafter, e.g.
``--draft-setting eagle_vocab=0 --draft-setting dtype=float32``. ``--cut on|off|both`` replays
with the draft service's block-length policy (``draft_service.block_length``, learning from the
modelled costs), without it, or both; ``--pass-costs FILE`` keeps the measured pass costs in a
file and prices later runs with them, so runs compared across invocations share their prices.

``--save-prior FILE`` writes what one drafter's cut replay taught its block-length policy (the
acceptance of each draft source by depth, ``draft_service.block_length.save_prior``); measured
with ``--prompts distill:N`` (N of ``tandem distill``'s held-out generation prompts: templated
code, JSON, math, chat and prose, and held-out stdlib function openings; never the bench set) it
is what an eagle head ships as ``acceptance.json``, so a fresh draft service cuts blocks as a
warmed one does:

    python benchmarks/draft_replay.py --drafts auto -k 7 --cut on --prompts distill:48 \\
        --draft-setting draft_tree_nodes=0 \\
        --cache /tmp/distill-48.pt --save-prior tandem/data/eagle/gemma-3-270m/acceptance.json

That run drafts chains only; the tree nodes' sources come from a second one, written over the
first's file for those sources alone:

    python benchmarks/draft_replay.py --drafts auto -k 7 --cut on --prompts distill:48 \\
        --draft-setting draft_trees=always --prior-sources tree: \\
        --cache /tmp/distill-48.pt --save-prior tandem/data/eagle/gemma-3-270m/acceptance.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from draft_service.block_length import AcceptancePrior, AcceptanceTally, BlockLengthPolicy, load_prior, save_prior
from draft_service.loop import root_path
from draft_service.proposers import make_proposer
from draft_service.types import SamplingParams, TargetInfo
from tandem.tools.bench.prompts import Prompt, load_prompts
from tandem.config import DraftSettings
from tandem.models import load_model, tokenizer_fingerprint
from tandem.cpu.screened_head import screened_argmax_for
from target_service import kv_cache


def greedy_runs(loaded, prompts, max_tokens: int, cache: Path | None) -> list[dict]:
    """Per prompt: its domain, prompt length, prompt + greedy tokens, and the final hidden states."""
    computed_on = f"{loaded.name}:{loaded.quantization or loaded.dtype}"  # a cache of another target is redone
    if cache is not None and cache.is_file():
        runs = torch.load(cache)
        if len(runs) == len(prompts) and all(r["max_tokens"] == max_tokens and r.get("target", computed_on)
                                             == computed_on for r in runs):
            return runs
    runs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = loaded.tokenizer(prompt.prompt, return_tensors="pt").input_ids  # [1, prompt]
            out = loaded.model.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0]  # [prompt + new]
            hidden = loaded.model(input_ids=out[None], output_hidden_states=True).hidden_states[-1][0]
            runs.append(
                {
                    "domain": prompt.domain,
                    "prompt_len": ids.shape[1],
                    "ids": out.tolist(),
                    "hidden": hidden.float(),
                    "max_tokens": max_tokens,  # hidden: [seq, hidden]
                    "target": computed_on,
                }
            )
    if cache is not None:
        torch.save(runs, cache)
    return runs


def pass_costs(loaded, context: int, max_block: int, sweeps: int = 5) -> dict[int, float]:
    """Median seconds of a pass over n = 1 .. max_block tokens after ``context`` cached tokens.

    Greedy passes as the target runs them: through the screened LM head where the model gets one
    (``tandem.cpu.screened_head``), else the full logits. The sizes are interleaved over several
    sweeps, so a burst of load elsewhere on the machine shifts every size alike instead of one.
    """
    model = loaded.model
    screen = screened_argmax_for(model, loaded.device)
    ids = torch.randint(100, 20000, (1, context))  # [1, context]
    times: dict[int, list[float]] = defaultdict(list)

    def greedy_pass(n: int) -> None:
        if screen is None:
            model(input_ids=ids[:, :n], cache=cache, use_cache=True, logits_to_keep=0)
            return
        out = model(
            input_ids=ids[:, :n], cache=cache, use_cache=True, output_hidden_states=True,
            logits_to_keep=torch.empty(0, dtype=torch.long),
        )
        screen(out.hidden_states[-1][0])  # [n] tokens

    with torch.inference_mode():
        cache = kv_cache.new_cache()
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        for sweep in range(sweeps + 1):
            for n in range(1, max_block + 1):
                for _ in range(3):
                    started = time.perf_counter()
                    greedy_pass(n)
                    if sweep:  # the first sweep warms up
                        times[n].append(time.perf_counter() - started)
                    kv_cache.truncate(cache, context)
    return {n: statistics.median(t) for n, t in times.items()}


class CacheFlusher:
    """Evicts the CPU caches the way a target pass does, by writing ``mb`` MiB (0 = never)."""

    def __init__(self, mb: int) -> None:
        self.buffer = torch.zeros(mb * 2**20 // 4) if mb > 0 else None  # [mb MiB of float32]

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.add_(1.0)


def replay(
    proposer,
    run: dict,
    k: int,
    costs: dict[int, float],
    flush=lambda: None,
    propose_times: list | None = None,
    lengths: BlockLengthPolicy | None = None,
) -> tuple[int, int, float]:
    """(tokens after the first, rounds, their modelled seconds) of one prompt with one drafter;
    each proposal's seconds are appended to ``propose_times`` when given. ``lengths`` cuts the
    proposals as the draft service does, learning from the modelled costs."""
    ids, plen, hidden = run["ids"], run["prompt_len"], run["hidden"]
    end = len(ids)
    committed = plen + 1  # the prefill commits the first token
    session = proposer.new_session(ids[:committed], SamplingParams())
    seconds, rounds = 0.0, 0
    local = AcceptanceTally()
    try:
        while committed < end:
            budget = run["max_tokens"] - (committed - plen)
            flush()
            started = time.perf_counter()
            proposal = session.propose(max(0, min(k, budget - 1)))
            spent = time.perf_counter() - started
            seconds += spent
            if propose_times is not None:
                propose_times.append(spent)
            if lengths is not None and proposal.sources:  # chains and trees alike, as live
                proposal = proposal.cut(lengths.length(proposal.sources, local, parents=proposal.parents))
            drafts = proposal.token_ids
            # The target's greedy verdict: the longest root path (of a chain: prefix) it agrees with.
            path = root_path(proposal, ids[committed : committed + len(drafts)])
            accepted = len(path)
            new = ids[committed : committed + accepted + 1]
            # Row i of a verdict's hidden states produced committed token i: position - 1.
            session.commit(committed, new, hidden[committed - 1 : committed - 1 + len(new)])
            committed += len(new)
            seconds += costs[len(drafts) + 1]
            rounds += 1
            shapes = proposer.block_shapes  # trees or chains by measured rate (as live, one per service)
            if shapes is not None and proposal.shape:
                shapes.observe(proposal.shape, len(new), spent + costs[len(drafts) + 1])
            if lengths is not None and proposal.sources:
                lengths.observe(proposal.sources, accepted, len(drafts) + 1, costs[len(drafts) + 1], spent,
                                parents=proposal.parents, path=path)
                local.observe(proposal.sources, accepted, proposal.parents, path)
    finally:
        session.close()
    return end - plen - 1, rounds, seconds


DISTILL_PREFIX = "distill:"


def distill_prompts(spec: str) -> list[Prompt]:
    """``distill:N[:SEED]``: the first N held-out generation prompts of ``tandem distill`` (half of
    them stdlib function openings), labelled by what they ask for."""
    from tandem.tools.distill.corpus import generation_prompts

    count, _, seed = spec.removeprefix(DISTILL_PREFIX).partition(":")
    stream = generation_prompts(int(seed or 0), heldout=True, code_prefix_share=0.5)
    return [Prompt("distill", next(stream)) for _ in range(int(count))]


def write_prior(path: Path, rates: AcceptancePrior, measured_on: str, sources: str | None) -> None:
    """Saves ``rates``; with ``sources`` (a prefix) only theirs, over the other sources' rates
    (and provenance) already in ``path``."""
    if sources is not None and path.exists():
        kept = {key: rate for key, rate in load_prior(path).items() if not key[0].startswith(sources)}
        old = json.loads(path.read_text()).get("measured_on", "")
        rates = {**kept, **{key: rate for key, rate in rates.items() if key[0].startswith(sources)}}
        measured_on = f"{old}; {sources}* sources: {measured_on}"
    save_prior(path, rates, measured_on=measured_on)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-model", default="gemma-3-270m")
    parser.add_argument(
        "--target-dtype", default="auto", choices=["auto", "float32"],
        help="the served target's weights (auto) or their float32 dequantization, the target a head is distilled "
             "on; give each its own --cache",
    )
    parser.add_argument("--drafts", nargs="+", default=["ngram", "eagle", "ngram+eagle"])
    parser.add_argument("-k", "--num-speculative-tokens", type=int, nargs="+", default=[3])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--prompts", default=None,
        help="JSONL prompt set (default: the shared bench prompts), or distill:N[:SEED] (tandem distill's held-out prompts)",
    )
    parser.add_argument("--cache", type=Path, default=Path("/tmp/tandem-draft-replay.pt"))
    parser.add_argument("--json", type=Path, default=None, help="write the table as JSON")
    parser.add_argument("--draft-threads", type=int, default=1, help="torch threads while drafting (0 = all)")
    parser.add_argument("--flush-mb", type=int, default=64, help="MiB written before each proposal (0 = none)")
    parser.add_argument(
        "--draft-setting", action="append", default=[], metavar="NAME=VALUE", help="a DraftSettings field"
    )
    parser.add_argument(
        "--pass-costs", type=Path, default=None,
        help="JSON of pass milliseconds by tokens: read when it exists, else written from this run's measurement",
    )
    parser.add_argument(
        "--cut", choices=["off", "on", "both"], default="both",
        help="cut proposals as the draft service does (draft_service.block_length), send them whole, or both",
    )
    parser.add_argument(
        "--save-prior", type=Path, default=None, metavar="FILE",
        help="write the acceptance the block-length policy learned (one drafter, one K, --cut on)",
    )
    parser.add_argument(
        "--prior-sources", default=None, metavar="PREFIX",
        help="with --save-prior: write only the sources starting with PREFIX (e.g. 'tree:') and keep FILE's others",
    )
    parser.add_argument("--no-prior", action="store_true", help="start the block-length policy without the drafter's prior")
    args = parser.parse_args()
    if args.save_prior is not None and (len(args.drafts) != 1 or len(args.num_speculative_tokens) != 1 or args.cut != "on"):
        parser.error("--save-prior measures one drafter at one K with --cut on")
    if args.prior_sources is not None and args.save_prior is None:
        parser.error("--prior-sources selects what --save-prior writes")
    overrides = dict(item.split("=", 1) for item in args.draft_setting)

    loaded = load_model(args.target_model, device="cpu", dtype=args.target_dtype)
    if args.prompts and args.prompts.startswith(DISTILL_PREFIX):
        prompts = distill_prompts(args.prompts)
    else:
        prompts = load_prompts(args.prompts)
    runs = greedy_runs(loaded, prompts, args.max_tokens, args.cache)
    context = round(statistics.median(r["prompt_len"] for r in runs))
    max_block = max(args.num_speculative_tokens) + 1
    if args.pass_costs is not None and args.pass_costs.is_file():  # the same prices for runs compared
        costs = {int(n): ms / 1000 for n, ms in json.loads(args.pass_costs.read_text()).items()}
        if max_block > max(costs):
            parser.error(f"{args.pass_costs} prices blocks of up to {max(costs)} tokens, not {max_block}")
    else:
        costs = pass_costs(loaded, context, max_block)
        if args.pass_costs is not None:
            args.pass_costs.write_text(json.dumps({n: c * 1000 for n, c in costs.items()}))
    prefills = {}
    with torch.inference_mode():
        for i, run in enumerate(runs):
            started = time.perf_counter()
            loaded.model(input_ids=torch.tensor([run["ids"][: run["prompt_len"]]]), logits_to_keep=1)
            prefills[i] = time.perf_counter() - started
    print("pass over n tokens (ms): " + ", ".join(f"{n}: {c * 1000:.1f}" for n, c in costs.items()))
    text = loaded.model.config.get_text_config()
    info = TargetInfo(
        model_name=loaded.name,
        vocab_size=int(text.vocab_size),
        tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
        max_context_len=32768,
        eos_token_ids=(),
        hidden_size=int(text.hidden_size),
    )
    table = []
    flush = CacheFlusher(args.flush_mb)
    target_threads = torch.get_num_threads()
    for spec in args.drafts:
        settings = DraftSettings(draft_model=spec, target_model=args.target_model, device="cpu", **overrides)
        proposer = make_proposer(settings, info)
        torch.set_num_threads(args.draft_threads or target_threads)
        proposer.warm_up()
        cuts = {"off": [False], "on": [True], "both": [False, True]}[args.cut]
        for k, cut in ((k, cut) for k in args.num_speculative_tokens for cut in cuts):
            by_domain: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
            propose_times: list[float] = []
            prior = None if args.no_prior else proposer.acceptance_prior
            lengths = BlockLengthPolicy(prior=prior) if cut else None  # one per run, as one per draft service
            for i, run in enumerate(runs):
                tokens, rounds, seconds = replay(proposer, run, k, costs, flush, propose_times, lengths)
                for key in (run["domain"], "all"):
                    row = by_domain[key]
                    row[0] += tokens
                    row[1] += rounds
                    row[2] += prefills[i] + seconds
                    row[3] += prefills[i] + tokens * costs[1]
            cells = {d: {"speedup": r[3] / r[2], "tokens_per_round": r[0] / r[1]} for d, r in by_domain.items()}
            propose_ms = 1000 * statistics.fmean(propose_times)
            table.append(
                {"draft": spec, "k": k, "cut": cut, "settings": overrides, "propose_ms": propose_ms, "domains": cells}
            )
            if args.save_prior is not None and lengths is not None:
                measured = f"benchmarks/draft_replay.py --drafts {spec} -k {k} --prompts {args.prompts or 'bench'}" + "".join(
                    f" --draft-setting {name}={value}" for name, value in overrides.items())
                write_prior(args.save_prior, lengths.acceptance.rates(), f"{len(runs)} prompts: {measured}",
                            args.prior_sources)
            order = ["all", *sorted(d for d in cells if d != "all")]
            print(
                f"{spec:>14} K={k}{' cut' if cut else ''} (draft {propose_ms:.2f} ms/round): "
                + "  ".join(f"{d} {cells[d]['speedup']:.2f}x ({cells[d]['tokens_per_round']:.2f}/round)" for d in order)
            )
    if args.json is not None:
        args.json.write_text(json.dumps({"pass_ms": {n: c * 1000 for n, c in costs.items()}, "rows": table}, indent=2))


if __name__ == "__main__":
    main()
