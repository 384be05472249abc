"""The three kinds of draft calibrate can score against a target's teacher-forced pass.

For one prompt the target has produced ``seq`` (prompt + its own greedy continuation) and, in one
forward pass over it, logits [L, V] (and final hidden states [L, H] when a drafter needs them).
Target position j (P-1 <= j <= L-2, P the prompt length) predicts seq[j+1], a continuation token.

- ``hf``: a standalone LM sees the same tokens; its q at j is exactly what it would propose after
  accepting seq[..j], so one pass gives every position, and acceptance does not depend on depth.
- ``eagle``: the head drafts seq[j+1] from the target's feature at j-1 and seq[j]; deeper drafts
  feed its own predicted features forward, so each start is rolled out ``max_k`` steps and the
  acceptance is measured per depth.
- ``ngram``: prompt lookup has no distribution, only proposals: measured match rate only (no KL).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from tandem.tools.calibrate.compare import Stats, align_vocab, compare, leading_matches

CHUNK = 16  # positions per softmax over the full vocabulary (262k for Gemma): bounds memory


class CalibrateError(ValueError):
    """Arguments or models calibrate cannot work with; the message says what to do."""


@dataclass
class TargetPass:
    seq: torch.Tensor  # [L] int64: prompt + greedy continuation
    prompt_len: int
    logits: torch.Tensor  # [L, V] float32
    hidden: torch.Tensor | None  # [L, H] float32 final hidden states (hidden_states[-1])


@dataclass(frozen=True)
class Precision:
    label: str  # "float32", "bfloat16", "GGUF q4_k_m (quantised)", ...
    quantised: bool


_GGUF_TYPE = re.compile(r"(iq\d_\w+?|q\d_k_[sml]|q\d_k|q\d_\d|bf16|f16|f32)(?=\.gguf$|[-_.])", re.IGNORECASE)


def checkpoint_precision(hf_dir: Path) -> Precision:
    """What the weights were before loading: a GGUF-converted checkpoint (tandem.models writes the
    GGUF path into ``.complete``) counts as quantised unless the GGUF was itself 16/32-bit."""
    complete = Path(hf_dir) / ".complete"
    if complete.is_file():
        try:
            source = str(json.loads(complete.read_text()).get("source", ""))
        except ValueError:
            source = ""
        if source.endswith(".gguf"):
            match = _GGUF_TYPE.search(Path(source).name)
            kind = match.group(1).lower() if match else "unknown type"
            if kind in ("f32", "f16", "bf16"):
                return Precision({"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[kind], False)
            return Precision(f"GGUF {kind} (quantised)", True)
    try:
        config = json.loads((Path(hf_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return Precision("unknown", False)
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if config.get("quantization_config"):
        return Precision(f"{config['quantization_config'].get('quant_method', 'quantised')} (quantised)", True)
    return Precision(str(dtype), False)


class Drafter(Protocol):
    kind: str
    description: str
    precision: Precision | None
    needs_hidden: bool

    def score(self, target: TargetPass, max_k: int) -> Stats: ...

    def step_seconds(self, target: TargetPass, steps: int) -> float: ...


def _median_seconds(fn: Any, steps: int, warmup: int = 2, sync: Any = None) -> float:
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def lm_step_seconds(model: Any, prompt: torch.Tensor, steps: int) -> float:
    """Median wall time of one batch-1 decode step with a KV cache (as the services run them),
    after a prefill of ``prompt``."""
    from transformers import DynamicCache

    device = prompt.device
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=prompt[None], cache=cache, use_cache=True, logits_to_keep=1)
        state = {"token": out.logits[:, -1:].argmax(-1)}

        def step() -> None:
            result = model(input_ids=state["token"], cache=cache, use_cache=True, logits_to_keep=1)
            state["token"] = result.logits[:, -1:].argmax(-1)

        return _median_seconds(step, steps, sync=sync)


def lm_verify_seconds(model: Any, prompt: torch.Tensor, block: torch.Tensor, steps: int) -> float:
    """Median wall time of one forward over ``block`` ([n] tokens) on a cache holding ``prompt``,
    rolled back after each: what verifying K drafted tokens (n = K + 1) costs the target."""
    from transformers import DynamicCache

    sync = torch.cuda.synchronize if prompt.device.type == "cuda" else None
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=prompt[None], cache=cache, use_cache=True, logits_to_keep=1)

        def verify() -> None:
            model(input_ids=block[None], cache=cache, use_cache=True)
            cache.crop(-block.shape[0])  # transformers 5: a negative count of positions to drop

        return _median_seconds(verify, steps, warmup=1, sync=sync)


def continuation_positions(target: TargetPass) -> torch.Tensor:
    """Target positions whose next token is a continuation token: P-1 .. L-2."""
    return torch.arange(target.prompt_len - 1, target.seq.shape[0] - 1)


def runs_from_matches(matches: torch.Tensor, max_k: int) -> list[int]:
    """Greedy accepted length from every start whose K-window fits: leading matches of match[s:s+K]."""
    n = matches.shape[0]
    if n < max_k:
        return []
    windows = matches.unfold(0, max_k, 1)  # [n - K + 1, K]
    return leading_matches(windows).tolist()


class HFDrafter:
    kind = "hf"
    needs_hidden = False

    def __init__(self, loaded: Any, spec: str, precision: Precision) -> None:
        self.loaded = loaded
        self.description = f"draft model {spec}"
        self.precision = precision

    def score(self, target: TargetPass, max_k: int) -> Stats:
        stats = Stats(max_k)
        with torch.inference_mode():
            q_logits = self.loaded.model(input_ids=target.seq[None].to(self.loaded.device)).logits[0].float().cpu()
        positions = continuation_positions(target)
        matches = []
        for chunk in positions.split(CHUNK):
            logp = torch.log_softmax(target.logits[chunk], dim=-1)
            logq = align_vocab(torch.log_softmax(q_logits[chunk], dim=-1), logp.shape[1])
            result = compare(logp, logq)
            stats.kl += result.kl.tolist()
            stats.greedy_match += result.greedy_match.tolist()
            stats.outside_mass += result.outside_mass.tolist()
            # A standalone draft sees the accepted tokens themselves: its acceptance does not
            # depend on the depth, and is recorded once, at depth 1.
            stats.overlap_by_depth[0] += result.overlap.tolist()
            matches.append(result.greedy_match)
        stats.runs = runs_from_matches(torch.cat(matches), max_k) if matches else []
        return stats

    def step_seconds(self, target: TargetPass, steps: int) -> float:
        prompt = target.seq[: target.prompt_len].to(self.loaded.device)
        return lm_step_seconds(self.loaded.model, prompt, steps)


class EagleDrafterScorer:
    kind = "eagle"
    needs_hidden = True

    def __init__(self, drafter: Any, head_dir: Path, precision: Precision) -> None:
        self.drafter = drafter  # tandem.models.eagle.EagleDrafter
        self.description = f"eagle head {head_dir}"
        self.precision = precision

    def score(self, target: TargetPass, max_k: int) -> Stats:
        assert target.hidden is not None
        stats = Stats(max_k)
        seq, last = target.seq, target.seq.shape[0] - 2  # last target position with a known next token
        vocab_ids = self.drafter.vocab_ids
        # Start i drafts seq[i+1] from (feature at i-1, seq[i]); starts cover the continuation.
        starts = torch.arange(max(1, target.prompt_len - 1), last + 1)
        matches = torch.zeros((starts.shape[0], max_k), dtype=torch.bool)
        for chunk_index, chunk in enumerate(starts.split(CHUNK)):
            row0 = chunk_index * CHUNK
            feature = target.hidden[chunk - 1]  # [c, H]
            for depth in range(max_k):
                position = chunk + depth  # target position whose next token is drafted
                valid = position <= last
                if not valid.any():
                    break
                position = position.clamp(max=last)
                feature, logits = self.drafter.step(feature, seq[position])  # [c, H], [c, R]
                logp = torch.log_softmax(target.logits[position], dim=-1)  # [c, V]
                logq = torch.full_like(logp, float("-inf"))
                logq[:, vocab_ids] = torch.log_softmax(logits.float(), dim=-1)
                result = compare(logp[valid], logq[valid])
                stats.overlap_by_depth[depth] += result.overlap.tolist()
                if depth == 0:
                    stats.kl += result.kl.tolist()
                    stats.greedy_match += result.greedy_match.tolist()
                    stats.outside_mass += result.outside_mass.tolist()
                matches[row0 : row0 + chunk.shape[0]][valid, depth] = result.greedy_match
        full = starts + max_k - 1 <= last  # starts whose whole K-window is in the continuation
        stats.runs = leading_matches(matches[full]).tolist()
        return stats

    def step_seconds(self, target: TargetPass, steps: int) -> float:
        assert target.hidden is not None
        state = {"feature": target.hidden[target.prompt_len - 1 : target.prompt_len], "token": target.seq[-1:]}

        def step() -> None:
            state["feature"], logits = self.drafter.step(state["feature"], state["token"])
            state["token"] = self.drafter.vocab_ids[logits.argmax(-1)]

        return _median_seconds(step, steps)


class NgramDrafterScorer:
    kind = "ngram"
    needs_hidden = False
    precision = None
    description = "prompt lookup (ngram): not a distribution, measured match rate only"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def propose(self, tokens: Any, k: int) -> list[int]:
        import numpy as np

        from draft_service.proposers.ngram import find_continuation

        start = find_continuation(tokens, self.ngram_max, self.ngram_min)
        return [] if start is None else np.resize(tokens[start:], k).tolist()

    def score(self, target: TargetPass, max_k: int) -> Stats:
        stats = Stats(max_k)
        tokens = target.seq.numpy()
        length = tokens.shape[0]
        # After committing tokens[:i], the draft proposes tokens[i:i+K]; i = P .. L-1.
        for i in range(target.prompt_len, length):
            proposal = self.propose(tokens[:i], max_k)
            truth = tokens[i : i + max_k].tolist()
            hits = [a == b for a, b in zip(proposal, truth)]
            stats.greedy_match.append(bool(hits[:1] == [True]))
            if i + max_k <= length:
                run = 0
                while run < len(hits) and hits[run]:
                    run += 1
                stats.runs.append(run)
        return stats

    def step_seconds(self, target: TargetPass, steps: int) -> float:
        tokens = target.seq.numpy()
        return _median_seconds(lambda: self.propose(tokens, 8), steps)
