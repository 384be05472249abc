"""Proposers: how the draft service drafts tokens (one module each; ``base`` is the interface)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from draft_service.proposers.base import Proposer, ProposerSession
from draft_service.types import TargetInfo
from tandem.config import DraftSettings
from tandem.models import (
    BUILTIN_MODELS,
    EAGLE_DRAFT,
    MODEL_FREE_DRAFTS,
    NGRAM_FIRST_PREFIX,
    ModelSpecError,
    is_eagle_draft,
    ngram_first_head,
    resolve_draft_spec,
)

if TYPE_CHECKING:
    from draft_service.proposers.eagle import EagleProposer

log = logging.getLogger(__name__)


def eagle_head_dir(draft_spec: str, target_model: str) -> Path:
    """The head directory a draft SPEC names: ``eagle`` = the head shipped for the built-in target
    ``target_model``; otherwise the SPEC is the head directory itself.

    Raises ModelSpecError when ``eagle`` has no shipped head for that target.
    """
    if draft_spec != EAGLE_DRAFT:
        return Path(draft_spec).expanduser()
    from tandem.models.eagle import BUILTIN_HEADS_DIR, builtin_head_dir

    head = builtin_head_dir(target_model) if target_model in BUILTIN_MODELS else None
    if head is None:
        shipped = sorted(p.name for p in BUILTIN_HEADS_DIR.glob("*") if (p / "eagle.json").is_file())
        raise ModelSpecError(
            f"there is no built-in eagle head for target {target_model!r} (heads ship for: "
            f"{', '.join(shipped) or 'none'}); train one with `tandem distill --kind eagle --target-model "
            f"{target_model} --output DIR` and pass DIR as --draft-model, or use --draft-model ngram"
        )
    return head


def make_proposer(settings: DraftSettings, target: TargetInfo) -> Proposer:
    """The proposer ``settings.draft_model`` names: ``auto`` (``tandem.models.resolve_draft_spec``),
    ``ngram``, ``eagle`` or an eagle head directory, ``ngram+eagle`` / ``ngram+HEAD_DIR`` (lookup
    first, the head otherwise), or a model SPEC for ``hf``.

    Takes the target's Info because a model draft must not propose ids beyond the target's
    vocabulary, and an eagle head must have been trained for this very target.
    Loading a model takes seconds: call it off the event loop.
    """
    spec = resolve_draft_spec(settings.draft_model, settings.target_model)
    if spec == "ngram":
        from draft_service.proposers.ngram import NgramProposer

        return NgramProposer(settings.ngram_max, settings.ngram_min)
    head = ngram_first_head(spec)
    if head is not None:
        from draft_service.proposers.ngram import NgramProposer
        from draft_service.proposers.ngram_first import NgramFirstProposer

        ngram = NgramProposer(settings.ngram_max, settings.ngram_min)
        return NgramFirstProposer(
            ngram,
            _load_eagle(head, settings, target),
            head_k=settings.eagle_k,
            overrule_confidence=settings.eagle_overrule_confidence,
            tree_nodes=settings.draft_tree_nodes,
            tree_top_k=settings.draft_tree_top_k,
            measure_shapes=settings.draft_trees == "measured",
        )
    if is_eagle_draft(spec):
        return _load_eagle(spec, settings, target)
    if spec.startswith(NGRAM_FIRST_PREFIX):
        raise ModelSpecError(
            f"draft {spec!r}: after {NGRAM_FIRST_PREFIX!r} comes 'eagle' or an eagle head directory (one holding eagle.json)"
        )
    if spec in MODEL_FREE_DRAFTS:
        raise ValueError(f"draft {spec!r} is not available in this draft service")
    from draft_service.proposers.hf import HfProposer
    from tandem.models import load_model

    loaded = load_model(spec, device=settings.device, dtype=settings.dtype)
    return HfProposer(loaded, vocab_limit=target.vocab_size, draft_top_k=settings.draft_top_k)


def _load_eagle(spec: str, settings: DraftSettings, target: TargetInfo) -> EagleProposer:
    import torch

    from draft_service.proposers.eagle import EagleProposer
    from tandem.models import pick_device, pick_dtype, resolve

    # A head step is a few MB of weights for one row, so its cost is reading them: bf16 halves that
    # ("auto"), and on a CPU with a quantized kernel (tandem.quant's probe) Q8_0 blocks halve it
    # again; the drafts either picks are as good (figures: docs/drafting.md#draft-head-precision).
    dtype = "bfloat16" if settings.dtype == "auto" else pick_dtype(settings.dtype, "cpu")
    device = pick_device(settings.device)
    kernel = _head_kernel(device) if settings.dtype == "auto" else None
    return EagleProposer.load(
        eagle_head_dir(spec, settings.target_model),
        resolve(settings.target_model).hf_dir,
        target,
        device=device,
        draft_top_k=settings.draft_top_k,
        min_confidence=settings.eagle_min_confidence,
        dtype=getattr(torch, dtype),
        vocab_limit=settings.eagle_vocab,
        kernel=kernel,
    )


def _head_kernel(device: str):
    """The quantized kernel a CPU head computes with, or None (bf16 then; the log says why)."""
    if device != "cpu":
        return None
    from tandem.quant.native import KernelUnavailable, load_kernel

    try:
        return load_kernel()
    except KernelUnavailable as error:
        log.info("eagle head steps in bfloat16: %s", error)
        return None


__all__ = ["Proposer", "ProposerSession", "eagle_head_dir", "make_proposer"]
