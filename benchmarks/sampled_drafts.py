"""How often a sampled session's first draft can be accepted, by what drafts it and with which q.

    python benchmarks/sampled_drafts.py                       # the 24 bench prompts, 40 tokens each
    python benchmarks/sampled_drafts.py --limit 8 --temperature 0.7 --json out.json

A draft x drawn from q is accepted with probability min(1, p(x) / q(x)), so the first draft of a
block is accepted with probability sum_x min(p(x), q(x)) (one minus the total variation between
the target's p and the draft's q); a deterministic draft (prompt lookup: q one-hot on x) with p(x).
This computes both exactly, without sampling a draft, at every position of a continuation sampled
from the target at ``--temperature``, with the target's true hidden states as the head's feature
(what a verdict brings it live):

- the eagle head's q by its top-k (``draft_top_k``, 0 = its whole draft vocabulary) and by a
  temperature on its logits beyond the session's (``tau``: the lever of a mis-calibrated head);
- where ``ngram+eagle`` drafts by prompt lookup (a match longer than one token, or a one-token
  match the head does not overrule), lookup's first draft beside the head's at the same positions.

And for draws keyed by position (docs/sampling.md#seeds: each position's token drawn from one
uniform or one set of Gumbel noises fixed by the seed and the position, a draft accepted only where
it equals that draw, so the output is the autoregressive one whatever the drafts), what the head's
first draft would be accepted with: proposing its most likely token (p of it), drawing by inverse
CDF from the same uniform in token-id order (the overlap of the two distributions' intervals), or
taking the argmax of log q plus the same Gumbel noises as the target (Monte Carlo, ``GUMBEL_DRAWS``
per position; the tokens outside q's support lumped into one, whose noise is then a Gumbel of
their summed mass).

Block acceptance deeper than the first draft, and what a round costs, are ``tandem bench``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draft_service.proposers import make_proposer
from draft_service.types import TargetInfo
from tandem.config import DraftSettings
from tandem.models import load_model, tokenizer_fingerprint
from tandem.rpc.types import SamplingParams
from tandem.tools.bench.prompts import load_prompts

GUMBEL_DRAWS = 4000
TOP_KS = (8, 16, 32, 64, 256, 0)
TAUS = (0.8, 0.9, 1.0, 1.1, 1.25)


def head_q(logits: torch.Tensor, top_k: int, tau: float) -> torch.Tensor:
    """logits [reduced] (already at the session's temperature) -> q [reduced]: the top-k renormalised."""
    scaled = logits / tau
    if top_k <= 0 or top_k >= scaled.shape[0]:
        return torch.softmax(scaled, dim=-1)
    values, ids = scaled.topk(top_k)
    return torch.zeros_like(scaled).scatter_(0, ids, torch.softmax(values, dim=-1))


def keyed_acceptance(p: torch.Tensor, q: torch.Tensor, vocab_ids: torch.Tensor,
                     generator: torch.Generator) -> tuple[float, float, float]:
    """p [vocab] the target's, q [reduced] the head's over ``vocab_ids`` [reduced] (target ids) ->
    the first draft's acceptance with keyed draws: (the head's argmax, inverse-CDF coupled,
    Gumbel coupled)."""
    argmax = float(p[vocab_ids[q.argmax()]])
    support = q > 0  # [reduced]
    ids, q_s = vocab_ids[support], q[support]  # [s] target ids, their q
    order = ids.argsort()
    ids, q_s = ids[order], q_s[order].double()
    p64 = p.double()
    cum_p = p64.cumsum(0)  # [vocab]
    p_hi, p_lo = cum_p[ids], cum_p[ids] - p64[ids]  # each support token's interval under p
    q_hi = q_s.cumsum(0)
    q_lo = q_hi - q_s
    inverse_cdf = float((torch.minimum(p_hi, q_hi) - torch.maximum(p_lo, q_lo)).clamp_min(0).sum())
    p_s = p64[ids]
    rest = (1.0 - p_s.sum()).clamp_min(1e-300)
    target = torch.cat([p_s.log(), rest.log()[None]])  # [s + 1]: the lumped tail last
    draft = torch.cat([q_s.log(), torch.tensor([-float("inf")], dtype=torch.float64)])
    noise = -torch.log(-torch.log(torch.rand(GUMBEL_DRAWS, target.shape[0], generator=generator,
                                             dtype=torch.float64).clamp_min(1e-300)))  # [draws, s + 1]
    gumbel = float(((target + noise).argmax(1) == (draft + noise).argmax(1)).double().mean())
    return argmax, inverse_cdf, gumbel


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--limit", type=int, default=0, help="bench prompts to use (0: all)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    loaded = load_model(args.model, device="cpu", dtype="float32")
    model, tokenizer = loaded.model, loaded.tokenizer
    text = model.config.get_text_config()
    info = TargetInfo(model_name=loaded.name, vocab_size=int(text.vocab_size),
                      tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), max_context_len=32768,
                      eos_token_ids=(), hidden_size=int(text.hidden_size))
    proposer = make_proposer(DraftSettings(draft_model="ngram+eagle", target_model=args.model, device="cpu"), info)
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
    grid = defaultdict(float)  # (top_k, tau) -> summed acceptance
    lookup = defaultdict(lambda: [0, 0.0, 0.0])  # kind -> [positions, lookup's, the head's]
    positions = 0
    keyed = [0.0, 0.0, 0.0]  # the head's argmax, inverse-CDF coupled, Gumbel coupled
    noise_generator = torch.Generator().manual_seed(args.seed)
    prompts = load_prompts(None, 0)
    for prompt in prompts[: args.limit or len(prompts)]:
        ids = tokenizer(prompt.prompt, return_tensors="pt").input_ids  # [1, prompt]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=args.max_tokens, do_sample=True, temperature=args.temperature,
                                 top_k=0, top_p=1.0)[0]  # [prompt + new]
            result = model(input_ids=out[None], output_hidden_states=True)
        hidden, logits = result.hidden_states[-1][0], result.logits[0].float()  # [n, hidden], [n, vocab]
        start = ids.shape[1]
        session = proposer.new_session(out[:start].tolist(), sampling)
        session.commit(0, out[:start].tolist(), hidden[:start])
        head = session._eagle
        vocab_ids = head._proposer.drafter.vocab_ids  # [reduced] target ids
        for t in range(start, out.shape[0]):
            step = head._step_from_feature()
            if step is not None:
                p = torch.softmax(logits[t - 1] / args.temperature, dim=-1)  # [vocab]: the target's next token
                p_head = p[vocab_ids]  # [reduced]
                head_logits = step[1][0].float() / args.temperature  # [reduced]
                for top_k in TOP_KS:
                    for tau in TAUS:
                        grid[top_k, tau] += float(torch.minimum(p_head, head_q(head_logits, top_k, tau)).sum())
                positions += 1
                served = head_q(head_logits, proposer.eagle.draft_top_k, 1.0)
                for i, value in enumerate(keyed_acceptance(p, served, vocab_ids, noise_generator)):
                    keyed[i] += value
                proposal, match_len = session._ngram.lookup(1)
                if proposal.token_ids:
                    x = proposal.token_ids[0]
                    if match_len > 1:
                        kind = "strong match"
                    elif session._head_overrules(x, match_len):
                        kind = "weak match, overruled"
                    else:
                        kind = "weak match, kept"
                    q = head_q(head_logits, proposer.eagle.draft_top_k, 1.0)
                    for key in (kind, "lookup drafts" if kind != "weak match, overruled" else None):
                        if key:
                            row = lookup[key]
                            row[0] += 1
                            row[1] += float(p[x])
                            row[2] += float(torch.minimum(p_head, q).sum())
            session.commit(t, [int(out[t])], hidden[t : t + 1])

    print(f"{positions} positions, temperature {args.temperature}: the head's first draft accepted with probability")
    print("top-k \\ tau " + "".join(f"{tau:>8}" for tau in TAUS))
    for top_k in TOP_KS:
        print(f"{top_k or 'all':>11} " + "".join(f"{grid[top_k, tau] / positions:8.3f}" for tau in TAUS))
    print("keyed draws, the head's q as served (top-k as served, tau 1): its first draft accepted with probability")
    for name, total in zip(("its most likely token", "inverse CDF, same uniform", "Gumbel, same noises"), keyed):
        print(f"  {name:<26} {total / positions:.3f}")
    print("where ngram+eagle drafts by lookup: its first draft against the head's (top-k as served, tau 1)")
    for kind, (n, by_lookup, by_head) in lookup.items():
        print(f"  {kind:<22} {n:5d} positions  lookup {by_lookup / n:.3f}  head {by_head / n:.3f}")
    report = {
        "positions": positions, "temperature": args.temperature,
        "head": [{"top_k": k, "tau": tau, "acceptance": grid[k, tau] / positions} for k in TOP_KS for tau in TAUS],
        "keyed": {name: total / positions for name, total in zip(("argmax", "inverse_cdf", "gumbel"), keyed)},
        "lookup": {kind: {"positions": n, "lookup": a / n, "head": b / n} for kind, (n, a, b) in lookup.items()},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
