"""Proposers: how the draft service drafts tokens (one module each; ``base`` is the interface)."""

from __future__ import annotations

from draft_service.proposers.base import Proposer, ProposerSession
from draft_service.types import TargetInfo
from tandem.config import DraftSettings
from tandem.models import MODEL_FREE_DRAFTS


def make_proposer(settings: DraftSettings, target: TargetInfo) -> Proposer:
    """The proposer ``settings.draft_model`` names: ``ngram``, or a model SPEC for ``hf``.

    Takes the target's Info because a model draft must not propose ids beyond the target's vocabulary.
    Loading a model takes seconds: call it off the event loop.
    """
    if settings.draft_model == "ngram":
        from draft_service.proposers.ngram import NgramProposer

        return NgramProposer(settings.ngram_max, settings.ngram_min)
    if settings.draft_model in MODEL_FREE_DRAFTS:
        raise ValueError(f"draft {settings.draft_model!r} is not available in this draft service")
    from draft_service.proposers.hf import HfProposer
    from tandem.models import load_model

    loaded = load_model(settings.draft_model, device=settings.device, dtype=settings.dtype)
    return HfProposer(loaded, vocab_limit=target.vocab_size, draft_top_k=settings.draft_top_k)


__all__ = ["Proposer", "ProposerSession", "make_proposer"]
