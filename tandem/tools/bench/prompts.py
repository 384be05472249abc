"""The prompt set: JSONL rows ``{"domain": ..., "prompt": ...}``.

The built-in set ships in the package (``tandem/data/bench_prompts.jsonl``, a copy of the design's
``bench/prompts.jsonl``) so ``tandem bench`` works from an installed wheel, away from the repository.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    domain: str
    prompt: str


class PromptFileError(ValueError):
    """A prompt file that cannot be used (missing, not JSONL, rows without a prompt)."""


def load_prompts(path: str | None = None, limit: int = 0) -> list[Prompt]:
    """The rows of ``path`` (default: the built-in set), the first ``limit`` of them when limit > 0."""
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise PromptFileError(f"cannot read the prompt file {path}: {exc}") from exc
    else:
        text = resources.files("tandem.data").joinpath("bench_prompts.jsonl").read_text()
    prompts: list[Prompt] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(Prompt(str(row.get("domain", "all")), str(row["prompt"])))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PromptFileError(f"{path or 'built-in prompts'} line {number}: need {{domain, prompt}} JSON ({exc})") from exc
    if not prompts:
        raise PromptFileError(f"{path or 'built-in prompts'} holds no prompts")
    return prompts[:limit] if limit > 0 else prompts
