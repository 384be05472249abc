"""The peer: transformers' own assisted generation of the same prompts, in-process.

It answers "is the service worth it over ``model.generate(assistant_model=...)``?". transformers
5.x offers, for a decoder-only target at batch size 1 and greedy decoding:

- ``assistant_model=<draft>``: a small LM with the target's tokenizer drafts ``num_assistant_tokens``
  tokens per round (we fix that to K, schedule ``constant``, confidence early-exit off, to mirror
  tandem's fixed K);
- ``prompt_lookup_num_tokens=K``: n-gram prompt lookup, the counterpart of tandem's ``ngram`` draft.

Runs after the stack phases (never at the same time: the CPU is shared), one request at a time,
greedy, same prompts and max tokens. A streamer stamps every committed chunk (one per target
forward), which gives TTFT, ITL, TPOT and tokens per target forward like the stack's figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from tandem.tools.bench.client import PEER, RequestResult
from tandem.tools.bench.prompts import Prompt


class PeerError(RuntimeError):
    """A peer that cannot run as asked (model missing, tokenizers differ, ...)."""


class TimingStreamer:
    """A transformers streamer that only records when each chunk of new tokens arrived.

    ``generate`` first puts the prompt, then every chunk it commits (one per target forward).
    """

    def __init__(self) -> None:
        self.prompt_seen = False
        self.stamps: list[float] = []
        self.counts: list[int] = []

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.stamps.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        pass


@dataclass
class PeerRun:
    assistant: str  # what drafted, for the report
    results: list[RequestResult]
    device: str
    dtype: str


def _load_pair(target_spec: str, assistant_spec: str | None, k: int, device: str, dtype: str) -> tuple[Any, Any, str, dict]:
    from transformers.utils import logging as transformers_logging

    from tandem.models import ModelSpecError, load_model, tokenizer_fingerprint

    transformers_logging.disable_progress_bar()  # its weight-loading bar would cut through the bench's own
    try:
        target = load_model(target_spec, device=device, dtype=dtype)
    except (ModelSpecError, OSError) as exc:
        raise PeerError(f"peer: cannot load the target {target_spec!r}: {exc}") from exc
    if assistant_spec is None:
        return target, None, "prompt lookup (max_matching_ngram_size=2, transformers' default)", {
            "prompt_lookup_num_tokens": k
        }
    try:
        draft = load_model(assistant_spec, device=target.device, dtype=target.dtype)
    except (ModelSpecError, OSError) as exc:
        raise PeerError(f"peer: cannot load the assistant {assistant_spec!r}: {exc}") from exc
    if tokenizer_fingerprint(draft.tokenizer) != tokenizer_fingerprint(target.tokenizer):
        raise PeerError(
            f"peer: the assistant {assistant_spec!r} does not share the target's tokenizer; tandem never "
            "drafts across tokenizers, so neither does its peer (pick a draft made for this target)"
        )
    config = draft.model.generation_config
    config.num_assistant_tokens = k
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    return target, draft, f"assistant model {assistant_spec}", {"assistant_model": draft.model}


def _generate(target: Any, prompt: str, max_tokens: int, mode_kwargs: dict) -> tuple[list[int], TimingStreamer, float, float]:
    import torch

    tokenizer = target.tokenizer
    encoded = tokenizer(prompt, return_tensors="pt", add_special_tokens=True).to(target.device)
    streamer = TimingStreamer()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(
            **encoded, max_new_tokens=max_tokens, do_sample=False, top_k=None, top_p=None, temperature=None,
            streamer=streamer, pad_token_id=pad, **mode_kwargs,
        )
    end = time.perf_counter()
    return out[0, encoded["input_ids"].shape[1]:].tolist(), streamer, start, end


def run_peer(
    target_spec: str,
    assistant_spec: str | None,
    prompts: Sequence[Prompt],
    max_tokens: int,
    k: int,
    device: str = "auto",
    dtype: str = "auto",
    warmup: int = 1,
    on_done: Callable[[RequestResult], None] | None = None,
) -> PeerRun:
    """Loads the pair, warms up, then generates every prompt once (greedy, one at a time)."""
    target, _draft, assistant, mode_kwargs = _load_pair(target_spec, assistant_spec, k, device, dtype)
    try:
        for prompt in prompts[:warmup]:
            _generate(target, prompt.prompt, min(8, max_tokens), mode_kwargs)
    except (ValueError, TypeError) as exc:  # transformers refuses the pair
        raise PeerError(f"peer: transformers refused assisted generation with {assistant}: {exc}") from exc
    results: list[RequestResult] = []
    for index, prompt in enumerate(prompts):
        tokens, streamer, start, end = _generate(target, prompt.prompt, max_tokens, mode_kwargs)
        rounds = len(streamer.stamps)
        result = RequestResult(
            domain=prompt.domain,
            mode=PEER,
            completion_tokens=len(tokens),
            ttft_s=(streamer.stamps[0] if streamer.stamps else end) - start,
            e2e_s=end - start,
            chunk_gaps_s=[b - a for a, b in pairwise(streamer.stamps)],
            rounds=rounds,
            accepted_tokens=max(0, len(tokens) - rounds),
            text=target.tokenizer.decode(tokens, skip_special_tokens=True),
            prompt_index=index,
            started_at=start,
        )
        results.append(result)
        if on_done is not None:
            on_done(result)
    return PeerRun(assistant, results, target.device, target.dtype)
