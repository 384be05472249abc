"""``tandem bench``: speculative against autoregressive decoding of the same prompts, in one run.

Each prompt is sent once per tandem mode (``--modes``: ``speculation: "on"``, ``"off"``, ``"auto"``)
through a gateway's streaming completions API, and once to each ``--peer-url`` server (any
OpenAI-compatible one, standard fields only), interleaved (the order changes per prompt) so every
mode sees the same machine load, closed loop at a given concurrency or open loop at a Poisson
request rate. Then, alone on the machine, transformers' own assisted generation of the same
prompts runs in-process as a peer. Reports TTFT, ITL percentiles, TPOT, tokens/s, acceptance rate
and mean accepted length, overall and per domain; ``--json`` writes the report with a top-level
``speedup`` (speculative / autoregressive tokens/s), ``speedup_auto``, ``speedup_vs_peer`` and per
URL peer ``peers``; ``--plot`` draws it.

Modules: ``prompts`` (the prompt set), ``client`` (one streamed request), ``peers`` (URL peers),
``load`` (scheduling), ``run`` (the measured phases), ``metrics`` (per-mode figures), ``report``
(speedups, JSON), ``table`` (the text report), ``peer`` (assisted generation), ``plot`` (PNG),
``stack`` (a ``tandem serve`` of its own), ``cli`` (flags and the run).
"""

from __future__ import annotations

from tandem.tools.bench.cli import add_arguments, main
from tandem.tools.bench.client import AUTO, MODES, TANDEM_MODES, RequestResult, run_one
from tandem.tools.bench.metrics import ModeSummary, percentile, summarize
from tandem.tools.bench.prompts import Prompt, load_prompts
from tandem.tools.bench.report import Report, build_report, format_report

__all__ = [
    "AUTO",
    "MODES",
    "TANDEM_MODES",
    "ModeSummary",
    "Prompt",
    "Report",
    "RequestResult",
    "add_arguments",
    "build_report",
    "format_report",
    "load_prompts",
    "main",
    "percentile",
    "run_one",
    "summarize",
]
