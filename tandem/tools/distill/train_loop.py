"""A checkpointed, time-budgeted training loop shared by both kinds of draft.

Why its own module: resumability is the same problem for both kinds. The loop owns the step
counter, the learning-rate schedule, the progress bar and periodic checkpoints; the caller owns
the model and the loss. A checkpoint is a folder ``ckpt-<step>/`` (model weights as safetensors,
the optimizer state as plain tensors via torch.save, both inside the run dir only) and
``checkpoint.json`` pointing at the newest one is replaced atomically last, so a kill at any moment
leaves a loadable checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from tandem.files import atomic_write_text
from tandem.tools.distill.store import atomic_save_tensors

POINTER = "checkpoint.json"


@dataclass
class LoopState:
    step: int = 0
    samples: int = 0  # training windows (positions x unrolled steps) seen
    seconds: float = 0.0  # training wall time over all runs
    loss: float = 0.0  # smoothed
    accuracy: float = 0.0  # smoothed one-step agreement on training batches


@dataclass
class LoopConfig:
    lr: float = 1e-3
    warmup_steps: int = 10
    final_lr_fraction: float = 0.1
    checkpoint_seconds: float = 120.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0


def has_checkpoint(run_dir: Path) -> bool:
    return (Path(run_dir) / POINTER).is_file()


def load_checkpoint(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> LoopState:
    from safetensors.torch import load_file

    pointer = json.loads((Path(run_dir) / POINTER).read_text())
    folder = Path(run_dir) / pointer["folder"]
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    return LoopState(**pointer["state"])


def save_checkpoint(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: LoopState) -> None:
    run_dir = Path(run_dir)
    folder = run_dir / f"ckpt-{state.step:07d}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    atomic_save_tensors(folder / "model.safetensors", {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    atomic_write_text(run_dir / POINTER, json.dumps({"folder": folder.name, "state": asdict(state)}, indent=2))
    for old in run_dir.glob("ckpt-*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)


def clear_checkpoint(run_dir: Path) -> None:
    (Path(run_dir) / POINTER).unlink(missing_ok=True)
    for old in Path(run_dir).glob("ckpt-*"):
        shutil.rmtree(old, ignore_errors=True)


def make_optimizer(model: nn.Module, config: LoopConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)


def run(
    run_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: LoopState,
    step_fn: Callable[[int], tuple[torch.Tensor, int, float]],
    config: LoopConfig,
    deadline: float,
    max_steps: int | None,
    desc: str,
) -> LoopState:
    """Trains until the deadline or ``max_steps`` (total, over all runs); step_fn(step) -> (loss, samples, acc).

    The learning rate warms up over the first steps, then decays by cosine over the time (or steps)
    left in this invocation, so a run with a budget always ends annealed.
    """
    started = time.monotonic()
    budget = max(deadline - started, 1e-6)
    first_step = state.step
    last_ckpt = started
    bar = tqdm(total=max_steps, initial=state.step, unit="step", desc=desc, dynamic_ncols=True)
    model.train()
    while time.monotonic() < deadline and (max_steps is None or state.step < max_steps):
        progress = (time.monotonic() - started) / budget
        if max_steps is not None:
            progress = max(progress, (state.step - first_step) / max(max_steps - first_step, 1))
        scale = config.final_lr_fraction + (1 - config.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * min(progress, 1)))
        if state.step < config.warmup_steps:
            scale *= (state.step + 1) / config.warmup_steps
        for group in optimizer.param_groups:
            group["lr"] = config.lr * scale
        t0 = time.monotonic()
        loss, samples, acc = step_fn(state.step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        state.step += 1
        state.samples += samples
        state.seconds += time.monotonic() - t0
        beta = 0.0 if state.step == 1 else 0.95
        state.loss = beta * state.loss + (1 - beta) * float(loss.detach())
        state.accuracy = beta * state.accuracy + (1 - beta) * acc
        bar.update(1)
        bar.set_postfix(loss=f"{state.loss:.3f}", acc=f"{state.accuracy:.3f}", lr=f"{config.lr * scale:.1e}")
        if time.monotonic() - last_ckpt >= config.checkpoint_seconds:
            save_checkpoint(run_dir, model, optimizer, state)
            last_ckpt = time.monotonic()
    bar.close()
    save_checkpoint(run_dir, model, optimizer, state)
    model.eval()
    return state
