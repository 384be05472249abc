"""The on-disk feature cache of a distill run: safetensors shards plus a json manifest.

Collecting the target's features is the expensive half of distillation on a CPU, so every batch the
target processes becomes one shard, written atomically, and the manifest records how many jobs of
the deterministic job stream are done. A killed or repeated run reopens the cache and goes on from
there instead of recomputing.

One shard holds ``n`` sequences padded to the run's ``seq_len``::

    tokens         [n, L]     int32   the sequence (BOS first)
    valid          [n, L]     uint8   1 for real positions (right padding is 0)
    generated      [n, L]     uint8   1 where the token is the target's own greedy choice
    source         [n]        uint8   SOURCES index of where the sequence came from
    features       [n, L, H]  fp16    the target's final hidden state (post final norm)
    topk_ids       [n, L, k]  int32   the target's top-k next tokens at each position (argmax first)
    topk_logprobs  [n, L, k]  fp16    their log-probabilities over the full vocabulary
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tandem.files import atomic_write_text

SOURCES = ("generated", "stdlib", "pydoc", "json")
MANIFEST = "manifest.json"


def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)


@dataclass
class Manifest:
    target_model: str
    target_fingerprint: str
    hidden_size: int
    vocab_size: int
    seq_len: int
    topk: int
    seed: int
    jobs_done: int = 0
    train_shards: list[str] = field(default_factory=list)
    heldout_shards: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)  # source -> real positions collected (train)
    heldout_tokens: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0  # wall time spent collecting, over all runs


class FeatureStore:
    """Reads and appends shards; the manifest is the single source of truth for what is done."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory = Path(directory)
        self.manifest = manifest

    @classmethod
    def open(cls, directory: Path, fresh: Manifest) -> FeatureStore:
        """Opens an existing cache if it was made for the same target and shapes, else starts one."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / MANIFEST
        if path.exists():
            old = Manifest(**json.loads(path.read_text()))
            same = (old.target_fingerprint, old.hidden_size, old.vocab_size, old.seq_len, old.topk, old.seed) == (
                fresh.target_fingerprint, fresh.hidden_size, fresh.vocab_size, fresh.seq_len, fresh.topk, fresh.seed)
            if not same:
                raise SystemExit(
                    f"tandem distill: the feature cache in {directory} was collected for another target or "
                    "settings (target, seq-len, top-k or seed differ); use another --output or --features-dir"
                )
            return cls(directory, old)
        store = cls(directory, fresh)
        store.save_manifest()
        return store

    def save_manifest(self) -> None:
        atomic_write_text(self.directory / MANIFEST, json.dumps(asdict(self.manifest), indent=2) + "\n")

    @property
    def train_tokens(self) -> int:
        return sum(self.manifest.tokens.values())

    def add(self, shard: dict[str, torch.Tensor], heldout: bool, seconds: float) -> None:
        """Writes one shard, then the manifest that names it (so a crash in between loses only the shard)."""
        names = self.manifest.heldout_shards if heldout else self.manifest.train_shards
        name = f"{'heldout' if heldout else 'train'}-{len(names):05d}.safetensors"
        atomic_save_tensors(self.directory / name, shard)
        names.append(name)
        counts = self.manifest.heldout_tokens if heldout else self.manifest.tokens
        valid = shard["valid"].bool()
        for i, src in enumerate(SOURCES):
            n = int(valid[shard["source"] == i].sum())
            if n:
                counts[src] = counts.get(src, 0) + n
        self.manifest.jobs_done += 1
        self.manifest.seconds += seconds
        self.save_manifest()

    def load(self, heldout: bool) -> dict[str, torch.Tensor]:
        """All shards of one split concatenated along the sequence axis (kept in their stored dtypes)."""
        from safetensors.torch import load_file

        names = self.manifest.heldout_shards if heldout else self.manifest.train_shards
        if not names:
            raise SystemExit(f"tandem distill: no {'held-out' if heldout else 'training'} features in {self.directory}")
        parts = [load_file(str(self.directory / name)) for name in names]
        return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
