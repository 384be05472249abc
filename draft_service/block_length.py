"""How many of a proposal's drafts to send: the length that buys the most tokens per second.

A draft deep in a block is worth only the chance that it and every draft before it are accepted,
and a verification pass does not cost the same for every width: on one host a pass steps up once
its rows turn the LM head's product compute-bound, on another the cost rises evenly with the rows
(figures: docs/drafting.md#cut-blocks). A fixed K is right for one host and one kind of text at
best. So the draft service learns both sides as it serves and cuts each proposal where the expected
number of committed tokens per second of the round peaks:

    L* = argmax over L in 0..n of  (1 + sum_{i<=L} prod_{j<=i} p_j) / (cost(L + 1) + overhead)

- ``p_j``: the chance that draft j is accepted given that the drafts before it were, counted per
  *source* (what drafted it and how sure it was: ``lookup:8`` = copied from a span whose last 8
  to 15 tokens agree with the sequence's end, ``head:0.7`` = the eagle head gave it 70 to 80%)
  and depth in the block, over every verdict the service has seen (``AcceptanceTally``), and
  shrunk towards the session's own tally where the session has one. A fresh service starts from
  the drafter's measured rates where it ships them (an eagle head's ``acceptance.json``) instead
  of a coin flip per draft, which cut lookup's long copies short while it learned. The proposer names the
  sources (``Proposal.sources``); a proposal without them is sent whole.
- ``cost(n)``: the median seconds of the target's pass over n rows (the ``verify_seconds`` its
  verdicts report; where a target reports none, the whole round from sending to verdict), over the
  last rounds whose pass had n rows; sizes never seen are interpolated from the
  sizes next to them (extrapolated past the largest; ``tandem.pass_costs``), and without any the
  proposal is sent whole.
  ``overhead``: what a round costs whatever the length: the median time the proposer took, and the
  round trip to the session's target beyond its pass (measured per target, ``draft_service.hop``),
  so blocks grow with the distance to the target where acceptance allows.

Under load a block shares its pass with other sessions' rows (other blocks, decode steps, prompt
chunks; the verdict names the pass's rows and the tokens it committed). Its drafts then cost what
they add to a pass that everyone in it waits for, so the rate that is maximised is the pass's:

    L* = argmax over L of  (T_o + 1 + sum_{i<=L} prod_{j<=i} p_j) / (cost(R_o + L + 1) + overhead)

with ``R_o`` and ``T_o`` the rows and tokens of the others in recent passes (medians over the
service's last verdicts, whichever target gave them, as the pass costs are). Alone,
``R_o = T_o = 0`` and this is the rule above; beside many sessions a draft must add at least the
pass's own tokens per second of pass to be sent, so blocks shorten where the pass is bound by
arithmetic rather than by reading the weights (many rows on a CPU).

A token tree is cut the same way to its first L nodes (grown best first, they are its L most
probable paths): there the product runs over a node's path from the root, not over every draft
before it.

The numerator is the tokens a round commits in expectation (the accepted drafts plus the target's
own token), so cutting never changes which tokens are committed, only how many rounds it takes:
greedy output stays the target's, and a sampled block cut short is still verified exactly.
Cutting is per round and myopic (it maximises this round's rate rather than the long-run one),
which is what makes it cheap; ``benchmarks/draft_replay.py --cut`` compares it with fixed K
(figures: docs/drafting.md#cut-blocks).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.pass_costs import COST_WINDOW, PassCosts
from tandem.rpc.token_tree import ROOT, depths

log = logging.getLogger(__name__)

LOG_EVERY = 256  # rounds between two debug lines with the learned costs
MAX_DEPTH_BUCKET = 4  # depths 4 and beyond share their tallies
# A session's own tallies count against the service's as if the service's rate had been seen this
# many times in the session: text that copies itself (JSON) and text that does not (prose) differ
# more than one service-wide rate per source can say.
SESSION_PRIOR_WEIGHT = 8.0
EXPLORE_EVERY = 16  # every so many proposals go whole, so tallies of what is usually cut stay current
# A prior's rate counts as this many judged drafts of its (source, depth): enough that a fresh
# service does not start from "every draft is a coin flip", few enough that the text it serves
# outvotes the prior within a request or two.
PRIOR_WEIGHT = 16.0
PRIOR_FORMAT = 1
MIN_PRIOR_OFFERED = 8  # drafts a (source, depth) needs before a measured prior records its rate

# (source, depth bucket) -> acceptance rate: what a drafter's sources are known to be worth
AcceptancePrior = dict[tuple[str, int], float]


@dataclass
class _Count:
    offered: int = 0
    accepted: int = 0


def confidence_source(kind: str, probability: float) -> str:
    """The source of a model's draft given the probability the model gave it, in tenths
    (``head:0.7`` for 0.7 <= p < 0.8): a model's confidence says much about acceptance, but its
    calibration is learned here, not assumed."""
    tenth = min(9, max(0, int(probability * 10)))
    return f"{kind}:{tenth / 10:.1f}"


class AcceptanceTally:
    """Acceptance per (source, depth), with a uniform prior (Laplace's rule of succession), or
    with ``prior`` rates (a drafter's measured habits, ``load_prior``) counted as ``prior_weight``
    drafts each where it has one."""

    def __init__(self, prior: Mapping[tuple[str, int], float] | None = None, prior_weight: float = PRIOR_WEIGHT) -> None:
        self._counts: dict[tuple[str, int], _Count] = {}
        self._prior = dict(prior or {})
        self._prior_weight = prior_weight

    @property
    def offered(self) -> int:
        """Drafts judged so far."""
        return sum(count.offered for count in self._counts.values())

    def estimate(self, source: str, depth: int) -> float:
        key = _key(source, depth)
        count = self._counts.get(key) or _Count()
        prior = self._prior.get(key)
        if prior is not None:
            return (count.accepted + 1 + self._prior_weight * prior) / (count.offered + 2 + self._prior_weight)
        return (count.accepted + 1) / (count.offered + 2)

    def rates(self, min_offered: int = MIN_PRIOR_OFFERED) -> AcceptancePrior:
        """The observed acceptance of every (source, depth) judged at least ``min_offered`` times."""
        return {key: count.accepted / count.offered for key, count in self._counts.items()
                if count.offered >= min_offered}

    def blended(self, source: str, depth: int, prior: float, weight: float) -> float:
        """This tally's rate shrunk towards ``prior`` as if ``prior`` had been seen ``weight`` times."""
        count = self._counts.get(_key(source, depth)) or _Count()
        return (count.accepted + weight * prior) / (count.offered + weight)

    def observe(self, sources: Sequence[str], num_accepted: int, parents: Sequence[int] = (),
                path: Sequence[int] = ()) -> None:
        """A tree (``parents``): the nodes of ``path`` (the accepted root path, root first) were
        accepted; every other child of the root or of a path node was judged and rejected; the rest
        were never judged (the target stops where its token has no child). A chain is the tree whose
        drafts each hang under the one before, its path the first ``num_accepted``: the draft after
        them was rejected, later ones never judged. A node at depth d counts where a chain's draft d
        does."""
        if not parents:
            parents, path = range(-1, len(sources) - 1), range(num_accepted)
        taken = set(path)
        for node, (source, parent, depth) in enumerate(zip(sources, parents, depths(parents))):
            if parent == ROOT or parent in taken:
                count = self._counts.setdefault(_key(source, depth - 1), _Count())
                count.offered += 1
                count.accepted += node in taken


def _key(source: str, depth: int) -> tuple[str, int]:
    return source, min(depth, MAX_DEPTH_BUCKET)


class PriorFileError(ValueError):
    """An acceptance prior file that cannot be used."""


def save_prior(path: Path, rates: AcceptancePrior, measured_on: str) -> None:
    """Writes ``rates`` as JSON: {"format", "measured_on", "rates": {source: [rate by depth or null]}}."""
    by_source: dict[str, list[float | None]] = {}
    for (source, depth), rate in sorted(rates.items()):
        row = by_source.setdefault(source, [None] * (MAX_DEPTH_BUCKET + 1))
        row[depth] = round(rate, 4)
    Path(path).write_text(json.dumps({"format": PRIOR_FORMAT, "measured_on": measured_on, "rates": by_source},
                                      indent=1) + "\n")


def load_prior(path: Path) -> AcceptancePrior:
    """Reads a file written by ``save_prior``; a malformed one is a PriorFileError naming the file."""
    try:
        doc = json.loads(Path(path).read_text())
        if doc.get("format") != PRIOR_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {PRIOR_FORMAT}")
        prior: AcceptancePrior = {}
        for source, row in doc["rates"].items():
            if not isinstance(source, str) or not isinstance(row, list) or len(row) > MAX_DEPTH_BUCKET + 1:
                raise ValueError(f"rates of {source!r} must be a list of at most {MAX_DEPTH_BUCKET + 1} entries")
            for depth, rate in enumerate(row):
                if rate is None:
                    continue
                if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (0.0 <= rate <= 1.0) \
                        or math.isnan(rate):
                    raise ValueError(f"rate {rate!r} of {source!r} at depth {depth} is not within [0, 1]")
                prior[(source, depth)] = float(rate)
        return prior
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PriorFileError(f"acceptance prior {path}: {exc}") from exc


class BlockLengthPolicy:
    """One per draft service (the target's costs and the drafter's habits are the service's, not a
    session's); sessions call ``length`` before sending a block and ``observe`` with its verdict."""

    def __init__(self, explore_every: int = EXPLORE_EVERY, prior: Mapping[tuple[str, int], float] | None = None) -> None:
        """``explore_every``: one proposal in so many is sent whole (0 = never), because the tallies
        only learn from drafts that are sent: a source judged poor on one kind of text would
        otherwise never get the chance to do better on another. ``prior``: the drafter's measured
        acceptance (``Proposer.acceptance_prior``), so a fresh service cuts as a warmed one would."""
        self.acceptance = AcceptanceTally(prior)
        self.costs = PassCosts()
        self._propose_seconds: deque[float] = deque(maxlen=COST_WINDOW)
        self._transport_seconds: deque[float] = deque(maxlen=COST_WINDOW)  # round trips beyond the pass
        # (rows, tokens) of the other sessions in the passes of the last verdicts
        self._others: deque[tuple[int, int]] = deque(maxlen=COST_WINDOW)
        self._explore_every = explore_every
        self._decisions = 0
        self._rounds = 0

    def length(self, sources: Sequence[str], session: AcceptanceTally | None = None,
               transport_s: float | None = None, parents: Sequence[int] = ()) -> int:
        """How many of the drafts named by ``sources`` to send (all of them until costs are known).

        A round is priced as the target's pass over its rows plus the hop: ``transport_s``, the
        round trip to the session's target beyond its pass (``draft_service.hop``, measured per
        target), else the service's own median. The hop is paid once a round whatever the length,
        so the farther the target, the longer the block that pays best.

        A token tree (``parents``) is cut to its first nodes the same way: a node is worth the
        chance that the target takes its path (its own rate times its parent's chance), and the
        first n nodes of a tree grown best-first are a tree of its most probable ones."""
        n = len(sources)
        parents = parents or range(-1, n - 1)  # a chain: each draft under the one before
        medians = self.costs.medians()
        if n == 0 or not medians:
            return n
        self._decisions += 1
        if self._explore_every and self._decisions % self._explore_every == 0:
            return n
        overhead = statistics.median(self._propose_seconds) if self._propose_seconds else 0.0
        if transport_s is None:
            transport_s = statistics.median(self._transport_seconds) if self._transport_seconds else 0.0
        overhead += transport_s
        others_rows, others_tokens = self.others()
        best_length, best_rate = n, -1.0
        expected = 1.0 + others_tokens  # tokens the pass commits in expectation
        reach: list[float] = []  # the chance the target takes each draft's path
        levels = depths(parents)
        for length in range(n + 1):
            if length:
                node = length - 1
                source, depth, parent = sources[node], levels[node] - 1, parents[node]
                p = self.acceptance.estimate(source, depth)
                if session is not None:
                    p = session.blended(source, depth, p, SESSION_PRIOR_WEIGHT)
                reach.append(p * (reach[parent] if parent != ROOT else 1.0))
                expected += reach[-1]
            seconds = self.costs.estimate(others_rows + length + 1, medians) + overhead
            rate = expected / seconds if seconds > 0 else float("inf")
            if rate > best_rate:
                best_length, best_rate = length, rate
        return best_length

    def others(self) -> tuple[float, float]:
        """The rows and tokens other sessions put in a pass beside a block of this service lately
        (medians; (0, 0) before any verdict or where the target names no pass)."""
        if not self._others:
            return 0.0, 0.0
        return (statistics.median(rows for rows, _ in self._others),
                statistics.median(tokens for _, tokens in self._others))

    def observe(
        self, sources: Sequence[str], num_accepted: int, rows: int, seconds: float | None, propose_seconds: float,
        verify_seconds: float = 0.0, parents: Sequence[int] = (), path: Sequence[int] = (),
        pass_rows: int = 0, pass_tokens: int = 0, committed: int | None = None,
    ) -> None:
        """A verdict of a block of ``rows - 1`` drafts (named by ``sources``, when the proposer
        names them) that took ``seconds`` from sending to verdict, of which the target's pass took
        ``verify_seconds`` (0: not reported, the whole round counts as the pass), and
        ``propose_seconds`` to draft. ``seconds`` None: the block went out while another was in
        flight (``draft_service.pipeline``), so its wait says nothing about the hop; only its pass
        is learned. A tree's verdict names its ``parents`` and accepted ``path`` (node indices).
        ``pass_rows`` and ``pass_tokens``: the whole pass's rows and committed tokens where the
        target names them (0: it does not), of which this block's ``rows`` and ``committed``
        tokens (default ``num_accepted + 1``); the pass's cost is learned by its rows."""
        if sources:
            self.acceptance.observe(sources, num_accepted, parents, path)
        if pass_rows >= rows:
            own_tokens = num_accepted + 1 if committed is None else committed
            self._others.append((pass_rows - rows, max(0, pass_tokens - own_tokens)))
            rows = pass_rows
        else:
            self._others.append((0, 0))
        if seconds is None:
            if verify_seconds > 0.0:
                self.costs.observe(rows, verify_seconds)
        elif 0.0 < verify_seconds <= seconds:
            self.costs.observe(rows, verify_seconds)
            self._transport_seconds.append(seconds - verify_seconds)
        else:
            self.costs.observe(rows, seconds)
        self._propose_seconds.append(propose_seconds)
        self._rounds += 1
        if self._rounds % LOG_EVERY == 0 and log.isEnabledFor(logging.DEBUG):
            costs = ", ".join(f"{rows}: {1000 * median:.1f}" for rows, median in self.costs.medians().items())
            log.debug("block-length policy after %d rounds: round ms by block width {%s}", self._rounds, costs)
