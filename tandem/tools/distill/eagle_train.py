"""Training the EAGLE-style head on cached target features, unrolled over its own predictions.

At draft time the head is fed the target's feature at the last committed position and the token
the target just committed, then K-1 times its own predicted feature and its own drafted token.
Training mirrors that: from every start t it predicts f_{t+1} from (f_t, x_{t+1}), then f_{t+2}
from (its prediction, x_{t+2}), and so on for ``unroll`` steps, with gradients through the whole
chain. The inputs x are the sequence's tokens (on the target's generations these are exactly the
target's choices, i.e. what an accepted draft feeds); the labels are the target's distributions at
each position (soft cross-entropy over the reduced vocabulary) plus a small regression term that
keeps predicted features near the target's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.tools.distill.soft_loss import soft_cross_entropy
from tandem.models.eagle import EagleHead, TargetTensors


@dataclass
class EagleTrainConfig:
    unroll: int = 5  # steps fed with the head's own features
    batch: int = 8  # sequences per optimizer step
    step_decay: float = 0.8  # weight of step j is step_decay**(j-1): early tokens gate the later ones
    feature_loss_weight: float = 0.1
    ce_fraction: float = 0.5  # positions per step that pay for the [reduced, hidden] logits product
    bf16: bool = True  # autocast matmuls to bfloat16 while training (faster on CPUs with bf16 units)
    one_step_share: float = 0.3  # curriculum: budget share trained one step ahead (cheap, learns fastest)
    ramp_share: float = 0.5  # then the unroll grows to ``unroll`` over this share


def unroll_at(config: EagleTrainConfig, progress: float) -> int:
    """Unroll depth for training progress in [0, 1]: one step first, then deeper, full depth at the end."""
    if progress < config.one_step_share:
        return 1
    ramp = (progress - config.one_step_share) / max(config.ramp_share, 1e-9)
    return min(config.unroll, 1 + math.ceil(ramp * (config.unroll - 1)))


@dataclass
class TrainData:
    """The training split on the training device, labels already mapped to reduced indices."""

    features: torch.Tensor  # [n, L, hidden] fp16
    tokens: torch.Tensor  # [n, L] int64
    valid: torch.Tensor  # [n, L] bool
    topk_reduced: torch.Tensor  # [n, L, k] int64, -1 outside the set
    topk_logprobs: torch.Tensor  # [n, L, k] fp16
    feature_scale: float  # RMS of the target's features (regression units)


def prepare(data: dict[str, torch.Tensor], table: torch.Tensor, device: str) -> TrainData:
    """table: [target_vocab] target id -> reduced index (-1 absent)."""
    valid = data["valid"].bool()
    feats = data["features"]
    scale = float(feats[valid].float().pow(2).mean().sqrt()) if valid.any() else 1.0
    return TrainData(
        features=feats.to(device),
        tokens=data["tokens"].long().to(device),
        valid=valid.to(device),
        topk_reduced=table[data["topk_ids"].long()].to(device),
        topk_logprobs=data["topk_logprobs"].to(device),
        feature_scale=scale,
    )


@torch.no_grad()
def init_from_data(head: EagleHead, data: TrainData, max_rows: int = 65536) -> None:
    """Data-dependent init of the head's scales (a fresh head only; a checkpoint overrides it).

    The target's features have a few dimensions tens of times larger than the rest, so after the
    RMS norm those few dominate the MLP's input and training crawls. Scaling each input dimension
    to unit size (the feature norm's weight) and each output dimension to the typical size of its
    step-to-step change (``out_scale``) conditions the problem without changing the module.
    """
    feats = data.features.float()  # [n, L, hidden]
    pairs = data.valid[:, 1:] & data.valid[:, :-1]  # [n, L-1]
    cur = feats[:, :-1][pairs][:max_rows]  # [m, hidden]
    nxt = feats[:, 1:][pairs][:max_rows]
    if cur.shape[0] < 2:
        return
    normed = cur / cur.pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-6)  # what RMSNorm sees
    per_dim = normed.pow(2).mean(0).sqrt()  # [hidden]
    head.norm_feature.weight.copy_(1.0 / per_dim.clamp(min=0.1 * float(per_dim.mean())))
    head.out_scale.copy_((nxt - cur).std(0).clamp(min=1e-3))


def embed(target: TargetTensors, ids: torch.Tensor) -> torch.Tensor:
    # [..] -> [.., hidden] float32 (same rows the drafter reads)
    return target.embed.index_select(0, ids.reshape(-1)).float().reshape(*ids.shape, -1)


def unroll(head: EagleHead, target: TargetTensors, features: torch.Tensor, tokens: torch.Tensor,
           steps: int, starts: int | None = None) -> list[torch.Tensor]:
    """features [b, L, hidden], tokens [b, L] -> per step j=1..steps predicted features [b, n, hidden].

    n = ``starts`` (default L - steps): start positions t = 0..n-1; it must leave room for ``steps``.
    """
    n = features.shape[1] - steps if starts is None else starts
    current = features[:, :n].float()  # [b, n, hidden]: the target's f_t
    preds = []
    for j in range(1, steps + 1):
        current = head(current, embed(target, tokens[:, j : j + n]))  # f_{t+j}
        preds.append(current)
    return preds


def make_step_fn(head: EagleHead, target: TargetTensors, data: TrainData, config: EagleTrainConfig, seed: int,
                 progress: Callable[[], float] = lambda: 1.0):
    """step -> (loss, windows, one-step accuracy); batches are a function of (seed, step), so resume replays none.

    ``progress()`` in [0, 1] drives the unroll curriculum (see ``unroll_at``).
    """
    device = data.features.device
    n_seq = data.features.shape[0]
    cap = head.config.logit_softcap

    def step_fn(step: int) -> tuple[torch.Tensor, int, float]:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randint(n_seq, (min(config.batch, n_seq),), generator=gen).to(device)
        feats, tokens = data.features[idx], data.tokens[idx]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=config.bf16):
            return _loss(feats, tokens, idx, gen)

    def _loss(feats: torch.Tensor, tokens: torch.Tensor, idx: torch.Tensor, gen: torch.Generator):
        depth = unroll_at(config, progress())
        weights = [config.step_decay**j for j in range(depth)]
        n = feats.shape[1] - config.unroll  # the same starts at every depth
        preds = unroll(head, target, feats, tokens, depth, starts=n)
        total = torch.zeros((), device=device)
        windows, acc = 0, 0.0
        for j, pred in enumerate(preds, start=1):
            mask = data.valid[idx, j : j + n]  # [b, n]
            if not mask.any():
                continue
            pick = mask & (torch.rand(mask.shape, generator=gen).to(device) < config.ce_fraction)
            if not pick.any():
                pick = mask
            logits = pred[pick] @ target.head_rows.T  # [m, reduced]
            if cap:
                logits = torch.tanh(logits / cap) * cap
            ce, hit = soft_cross_entropy(logits, data.topk_reduced[idx, j : j + n][pick],
                                         data.topk_logprobs[idx, j : j + n][pick])
            truth = feats[:, j : j + n].float()[mask] / data.feature_scale
            reg = F.smooth_l1_loss(pred[mask].float() / data.feature_scale, truth)
            total = total + weights[j - 1] * (ce + config.feature_loss_weight * reg)
            windows += int(mask.sum())
            if j == 1:
                acc = float(hit.float().mean())
        return total / sum(weights), windows, acc

    return step_fn


@torch.inference_mode()
def rollout_hits(head: EagleHead, target: TargetTensors, vocab_ids: torch.Tensor, data: dict[str, torch.Tensor],
                 steps: int, device: str, batch: int = 8) -> torch.Tensor:
    """Held-out split -> hits [seqs, L - steps, steps] bool: drafted token j from start t == target argmax at t+j."""
    head.eval()
    argmax = data["topk_ids"][..., 0].long()
    vocab_ids = vocab_ids.to(device)
    out = []
    for start in range(0, data["features"].shape[0], batch):
        feats = data["features"][start : start + batch].to(device)
        tokens = data["tokens"][start : start + batch].long().to(device)
        preds = unroll(head, target, feats, tokens, steps)
        n = feats.shape[1] - steps
        hits = []
        for j, pred in enumerate(preds, start=1):
            drafted = vocab_ids[(pred @ target.head_rows.T).argmax(-1)]  # [b, n] target ids
            hits.append(drafted.cpu() == argmax[start : start + batch, j : j + n])
        out.append(torch.stack(hits, dim=-1))
    return torch.cat(out)
