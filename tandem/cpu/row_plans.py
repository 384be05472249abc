"""Which product serves a packed model's one- and two-row linear calls, timed once on this host.

A decode step multiplies one row by every weight and a verification of one draft token two rows;
``tandem.cpu.linear`` packs the weights for oneDNN laid out for four rows. On some hosts that
packed product is the fastest at every row count; on others of the same CPU kind (slower memory)
its one- and two-row products are slower than its four-row one, for the layers and the LM head
alike. Which one wins is a property of the host, so it is measured, not assumed: at load, for one
and two rows, this times

* the layers as a pass reads them (every layer once, in order, so each weight streams from memory
  as it does in a forward pass), packed against ``padded_linear`` (the rows padded to four), and
* the LM head (the output embedding: the largest weight by far) packed, padded and ``few_row_linear``,

each the median of several sweeps (interleaved, after one that warms up), and gives the layers
concerned a ``row_plan`` where another product is clearly faster (``MARGIN``). About two seconds
for gemma-3-270m; models under ``MIN_BYTES`` of packed weights (tests' tiny models) are left alone.
Invariant: the products agree up to float summation order, as the packed one does with itself
across row counts, so a plan changes speed, never tokens beyond that rounding.

Medians, not minima, and a margin: a minimum rewards the one sweep the host left alone, a median
the usual one; with minima and a looser margin the layers' two-row choice flipped between loads.

``tune_screen_rows`` does the same for the greedy head's bfloat16 screen
(``tandem.cpu.screened_head``), timed right after the layers' products as in a pass, where its one-
and two-row products can be slower than four rows even when, timed alone after a cache flush, they
are not.

Figures (the hosts, the passes, the margins tried): docs/target.md#row-plans.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from tandem.cpu.linear import FEW, PAD, few_row_linear, packed_linear, padded_linear

log = logging.getLogger(__name__)

PACKED = "packed"
TUNED_ROWS = (1, 2)  # from three rows on the packed product is within noise of its four-row time
MIN_BYTES = 64 * 2**20  # packed weights of the model below which nothing is timed
MARGIN = 0.95  # another product must take at most this share of the packed product's time
SWEEPS = 9
MIN_SWEEPS = 3  # sweeps every decision gets, whatever its budget
SWEEP_BUDGET_S = 1.5  # past this, a decision stops sweeping (large models: each sweep streams GBs)
SCREEN_WARM_BYTES = 256 * 2**20  # layer weights streamed before each timing of the screen

# measure(layers, plan, rows) -> seconds for one call of each layer, in order.
Measure = Callable[[Sequence[torch.nn.Linear], str, int], float]
# screen_measure(plan, rows) -> seconds of the screen's product.
ScreenMeasure = Callable[[str, int], float]


class Screen(Protocol):
    """What ``tune_screen_rows`` needs of a screen (``tandem.cpu.screened_head.ScreenedArgmax``);
    structural, so this module does not import the one that calls it."""

    weight: torch.Tensor  # [vocab, hidden]
    packed: object
    row_plan: dict[int, str]

    def screen_logits(self, x: torch.Tensor, plan: str | None = None) -> torch.Tensor: ...


def tune_row_plans(model: torch.nn.Module, measure: Measure | None = None, min_bytes: int = MIN_BYTES) -> dict:
    """Sets ``row_plan`` on the model's packed float32 linears; returns what it chose, by part
    ("layers", "head") and row count."""
    packed = [
        m for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32 and _packed(m) is not None
    ]
    if sum(m.weight.numel() * m.weight.element_size() for m in packed) < min_bytes:
        return {}
    head = _output_embedding(model)
    parts = {"layers": ([m for m in packed if m is not head], (PACKED, PAD)),
             "head": ([head] if head in packed else [], (PACKED, PAD, FEW))}
    measure = measure or _timed_sweep
    chosen: dict[str, dict[int, str]] = {}
    for part, (layers, plans) in parts.items():
        if not layers:
            continue
        for rows in TUNED_ROWS:
            seconds = _sweeps(lambda plan, rows=rows, layers=layers: measure(layers, plan, rows), plans)
            best = _clearly_fastest(seconds)
            if best != PACKED:
                chosen.setdefault(part, {})[rows] = best
                for layer in layers:
                    layer.row_plan = {**getattr(layer, "row_plan", {}), rows: best}
            log.debug("%s at %d row(s): %s", part, rows, ", ".join(f"{p} {s * 1e3:.2f} ms" for p, s in seconds.items()))
    if chosen:
        log.info("one- and two-row products that beat oneDNN's packed one on this host: %s", chosen)
    return chosen


def tune_screen_rows(screen: Screen, model: torch.nn.Module, measure: ScreenMeasure | None = None) -> dict:
    """Sets ``screen.row_plan`` (one and two rows: PACKED or PAD); returns what it chose by row count.

    Each timing streams the model's packed layers first (one call each, as a pass does before
    its head, up to SCREEN_WARM_BYTES), so the screen runs with the caches and threads as a pass
    leaves them."""
    if not screen.packed:
        return {}
    head = _output_embedding(model)  # a greedy pass reads the screen instead
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head and _packed(m) is not None]
    measure = measure or (lambda plan, rows: _timed_screen(screen, layers, plan, rows))
    chosen: dict[int, str] = {}
    for rows in TUNED_ROWS:
        seconds = _sweeps(lambda plan, rows=rows: measure(plan, rows), (PACKED, PAD))
        if _clearly_fastest(seconds) == PAD:
            chosen[rows] = PAD
        log.debug("screen at %d row(s): %s", rows, ", ".join(f"{p} {s * 1e3:.2f} ms" for p, s in seconds.items()))
    screen.row_plan = dict(chosen)
    if chosen:
        log.info("bfloat16 screen products padded to four rows on this host: %s", sorted(chosen))
    return chosen


def _sweeps(measure: Callable[[str], float], plans: Sequence[str]) -> dict[str, float]:
    """Median seconds per plan over SWEEPS interleaved sweeps (so a busy moment hits every plan
    alike), after one that only warms up (oneDNN builds its kernels then); fewer, down to
    MIN_SWEEPS, where they take longer than SWEEP_BUDGET_S (for gemma-3-270m all nine take under
    half a second; a model ten times larger streams gigabytes per sweep)."""
    taken: dict[str, list[float]] = {plan: [] for plan in plans}
    started = time.perf_counter()
    for sweep in range(SWEEPS + 1):
        for plan in plans:
            seconds = measure(plan)
            if sweep:
                taken[plan].append(seconds)
        if sweep >= MIN_SWEEPS and time.perf_counter() - started > SWEEP_BUDGET_S:
            break
    return {plan: statistics.median(times) for plan, times in taken.items()}


def _clearly_fastest(seconds: dict[str, float]) -> str:
    """The fastest plan where it takes at most MARGIN of the packed product's time, else PACKED."""
    best = min(seconds, key=seconds.__getitem__)
    return best if best != PACKED and seconds[best] <= MARGIN * seconds[PACKED] else PACKED


def _timed_screen(screen: Screen, layers: Sequence[torch.nn.Linear], plan: str, rows: int) -> float:
    """Seconds of the screen's product over ``rows`` rows through ``plan``, after the layers'
    products (the first SCREEN_WARM_BYTES of them: enough to leave the caches as a pass does)."""
    x = torch.zeros(rows, screen.weight.shape[1], dtype=torch.bfloat16)  # [rows, hidden]
    streamed = 0
    with torch.inference_mode():
        for layer in layers:
            if streamed >= SCREEN_WARM_BYTES:
                break
            layer(torch.zeros(rows, layer.in_features, dtype=layer.weight.dtype))
            streamed += layer.weight.numel() * layer.weight.element_size()
        started = time.perf_counter()
        screen.screen_logits(x, plan)
        return time.perf_counter() - started


def _output_embedding(model: torch.nn.Module) -> torch.nn.Module | None:
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if callable(get_head) else None


def _packed(layer: torch.nn.Linear) -> torch.Tensor | None:
    holder = getattr(layer, "packed_weight", None)
    return holder.get(layer.weight) if holder is not None else None


def _timed_sweep(layers: Sequence[torch.nn.Linear], plan: str, rows: int) -> float:
    """Seconds to call every layer once with ``rows`` rows through ``plan``."""
    calls = []
    for layer in layers:
        x = torch.zeros(rows, layer.in_features)  # [rows, in]
        weight, packed = layer.weight.detach(), _packed(layer)
        if plan == FEW:
            calls.append(lambda x=x, w=weight: few_row_linear(x, w, contiguous=False))
        elif plan == PAD:
            calls.append(lambda x=x, p=packed: padded_linear(x, p))
        else:
            calls.append(lambda x=x, p=packed: packed_linear(x, p))
    with torch.inference_mode():
        started = time.perf_counter()
        for call in calls:
            call()
        return time.perf_counter() - started
