"""A request's sampling defaults from the model's own ``generation_config.json``, as vLLM applies them.

Model makers ship the sampling they tuned their model for (Llama 3 Instruct: temperature 0.6, top-p
0.9; Qwen 2.5 Instruct: temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05). A client
that sends no sampling fields (a chat frontend left at its defaults, an SDK call with none) then
gets what the model was tuned for rather than OpenAI's temperature 1 without truncation, as vLLM
(``--generation-config auto``, its default) and SGLang serve it. A field the request sends always
wins; ``--generation-config none`` keeps OpenAI's defaults. ``do_sample`` is not read (vLLM does
not either): a request without a temperature samples at the model's.

Only the fields tandem honours are taken (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``typical_p``, ``repetition_penalty``), and only values a request could send (``RANGES``, which
``gateway.validation`` checks requests against): one out of range is left out and logged, so a
start never fails on a checkpoint's generation config.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.rpc.types import MAX_REPETITION_PENALTY

log = logging.getLogger(__name__)

FILE = "generation_config.json"


# field: (whether a value is one a request may send, what it must be)
RANGES = {
    "temperature": (lambda v: 0.0 <= v <= 2.0, "between 0 and 2"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "top_k": (lambda v: v >= 0, ">= 0 (0 disables it)"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "in [0, 1] (0 disables it)"),
    "typical_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1] (1 disables it)"),
    "repetition_penalty": (lambda v: 0.0 < v <= MAX_REPETITION_PENALTY,
                           f"above 0 and at most {MAX_REPETITION_PENALTY:g} (1: none)"),
}


def in_range(name: str, value: float) -> bool:
    """Whether ``value`` is one a request may send for the sampling field ``name`` (``RANGES``)."""
    return (isinstance(value, int) or math.isfinite(value)) and RANGES[name][0](value)  # an int may pass float's


def _valid(name: str, value: object) -> bool:
    """Whether a generation config's ``value`` is one a request may send: a number (an integer for
    ``top_k``) in ``RANGES``."""
    if isinstance(value, bool) or not isinstance(value, int if name == "top_k" else (int, float)):
        return False
    return in_range(name, value)


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a field out gets; None: OpenAI's default (temperature 1, top-p 1,
    no top-k, no min_p, no typical_p, no repetition penalty)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def of_checkpoint(cls, folder: Path) -> SamplingDefaults:
        """The defaults in ``folder``'s generation config; none where it has no such file or it cannot
        be read."""
        path = folder / FILE
        if not path.is_file():
            return cls()
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            log.warning("sampling defaults: cannot read %s (%s); OpenAI's defaults apply", path, error)
            return cls()
        if not isinstance(config, dict):
            return cls()
        taken = {}
        for name in asdict(cls()):
            value = config.get(name)
            if value is None:
                continue
            if _valid(name, value):
                taken[name] = value
            else:
                log.warning("sampling defaults: %s's %s = %r is not a value a request may send; left out",
                            path, name, value)
        return cls(**taken)

    def given(self) -> dict[str, float]:
        """The fields this sets, for the start-up log."""
        return {name: value for name, value in asdict(self).items() if value is not None}


__all__ = ["SamplingDefaults"]
