"""The feature-conditioned draft (``eagle``): a small head on the target's own hidden states.

The head (``tandem.models.eagle``) predicts the target's next final hidden state from the current one and
the next token's embedding, and scores it with the target's own LM-head rows. So a session needs
one thing the token ids do not give: the target's feature at the position before the last
committed token. Every verdict brings it (the loop asks for hidden states in every block because
``wants_hidden_states``): row i of a verdict's hidden states is the feature whose logits produced
committed token i, so the last row is exactly the feature to draft from next.

A fresh session has only token ids (the Speculate request; the prefill's hidden states went to
the gateway), so its first proposal is empty: the target then commits one token, like a decode
step, and returns the feature that produced it. From then on each proposal runs ``step`` K times,
feeding its own predicted feature and drafted token forward.

Greedy sessions draft the argmax of the reduced-vocabulary logits, mapped to target ids. Sampling
sessions draw from the renormalised top-k of the tempered reduced logits (``TopKSampler``, with
its seeding rules), and the block carries that exact sparse q in target ids, so the target's
rejection sampling stays exact: tokens outside the reduced vocabulary simply have q = 0.

Sessions live on the draft's single model thread (``tandem.models.worker``); no locking.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draft_service.block_length import AcceptancePrior, confidence_source, load_prior
from draft_service.errors import IncompatibleDraftError
from draft_service.proposers.base import WARMUP_TOKENS, Proposer, ProposerSession
from draft_service.proposers.rollout import FeatureRollout
from draft_service.proposers.sampling import TopKSampler
from draft_service.proposers.shaping import ShapedLogits
from draft_service.types import LogitShaping, Proposal, SamplingParams, SparseDist, TargetInfo
from tandem.models.eagle import (
    ACCEPTANCE_FILE,
    EagleConfig,
    EagleDrafter,
    TargetTensors,
    load_head,
    load_target_tensors,
    target_mismatches,
)
from tandem.quant.checkpoint import cached_embedding
from tandem.quant.native import QuantKernel
from tandem.quant.tensor import QuantizedTensor

log = logging.getLogger(__name__)

HEAD_SOURCE = "head"  # Proposal.sources: "head:0.7", a draft the head gave 70 to 80%


def check_head_fits_target(config: EagleConfig, head_name: str, target: TargetInfo) -> None:
    """Refuses a head trained for another target: its features and token ids would mean nothing.

    Compares what the head recorded at training time with the target's Info: the tokenizer
    fingerprint, the hidden size (0 in Info = not reported, not checked) and the vocabulary size.
    """
    problems = target_mismatches(config, target.tokenizer_fingerprint, target.hidden_size, target.vocab_size)
    if problems:
        raise IncompatibleDraftError(
            f"eagle head {head_name!r} was trained for target {config.target_model!r}, which does not match the "
            f"target model {target.model_name!r}: {'; '.join(problems)}. Train a head for this target with "
            f"`tandem distill --kind eagle`, or use the ngram draft"
        )


@dataclass(frozen=True)
class HeadGuesses:
    """The head's most likely next tokens after one position, for drafting a token tree.

    ``feature`` ([1, hidden]) is the feature the head predicted for that position: the step that
    expands one of the guesses takes it with the guessed token.
    """

    feature: torch.Tensor
    token_ids: tuple[int, ...]  # target ids, most probable first
    probs: tuple[float, ...]  # the head's softmax probability of each


class EagleSession(ProposerSession):
    """One session: its committed tokens and the target feature that belongs to their end.

    ``_feature`` ([hidden] float32) is the target's final hidden state at position
    ``_feature_len - 2`` (the one whose logits produced token ``_feature_len - 1``); it is only
    used while ``_feature_len`` equals the committed length, i.e. while it is current.
    """

    def __init__(self, proposer: EagleProposer, token_ids: Sequence[int], sampling: SamplingParams,
                 shaping: LogitShaping | None = None) -> None:
        if not token_ids:
            raise ValueError("a draft session needs at least one committed token")
        self._proposer = proposer
        self._tokens: list[int] = list(token_ids)
        # The target's penalties and bias, applied to every step's logits (draft_service.proposers.shaping).
        self._shaped = None
        if shaping is not None and shaping.active:
            self._shaped = ShapedLogits(shaping, proposer.drafter.vocab_ids)
            self._shaped.commit(self._tokens)
        self._feature: torch.Tensor | None = None
        self._feature_len = -1
        self._sampler = None if sampling.greedy else TopKSampler(sampling, proposer.draft_top_k)
        self._closed = False
        # The head's first step from the current feature, kept until the next commit: ``first_draft``
        # computes it to judge a lookup block, and a proposal right after starts from it.
        self._first_step: tuple[torch.Tensor, torch.Tensor] | None = None  # ([1, hidden], [1, reduced])
        # The head's own features for tokens taken as committed before a verdict.
        self._rollout = FeatureRollout(lambda feature, token_ids: proposer.drafter.step(feature, token_ids),
                                       proposer.device)

    @property
    def has_feature(self) -> bool:
        return self._feature is not None and self._feature_len == len(self._tokens)

    @property
    def feature(self) -> torch.Tensor | None:
        """The current feature [hidden] (None until a verdict brought one)."""
        return self._feature if self.has_feature else None

    def first_draft(self) -> tuple[int, float] | None:
        """The head's most likely next token (a target id) and the probability it gives it; None
        without a current feature. A proposal made before the next commit reuses this step."""
        step = self._step_from_feature()
        if step is None:
            return None
        probability, index = _top(step[1][0])
        return int(self._proposer.drafter.vocab_ids[index]), probability

    def guesses(self, k: int) -> HeadGuesses | None:
        """The head's top-``k`` tokens after the last committed one (its first step, kept until the
        next commit); None without a current feature."""
        step = self._step_from_feature()
        return None if step is None else self._top_k(*step, k)

    def guesses_after(self, features: torch.Tensor, tokens: Sequence[int], k: int) -> list[HeadGuesses]:
        """The head's top-``k`` tokens after each drafted token of ``tokens``, from the features
        [b, hidden] predicted for the positions before them (``HeadGuesses.feature`` of the guesses
        each was among), in one batched step: on a CPU a step is bound by reading the head and its
        LM-head rows, so b rows cost about what one does."""
        token_ids = torch.tensor(list(tokens), dtype=torch.long, device=self._proposer.device)  # [b]
        with torch.inference_mode():
            predicted, logits = self._step(features, token_ids)  # [b, hidden], [b, reduced]
        return [self._top_k(predicted[i : i + 1], logits[i : i + 1], k) for i in range(len(token_ids))]

    def next_tokens(self, n: int) -> tuple[int, ...]:
        """The head's top-``n`` after the last committed token (its first step, kept); each is
        remembered with the feature that produced it, so taking one as committed costs no step."""
        found = self.guesses(n) if n > 0 else None
        if found is None:
            return ()
        for token in found.token_ids:
            self.remember((token,), found.feature)
        return found.token_ids

    def _top_k(self, feature: torch.Tensor, logits: torch.Tensor, k: int) -> HeadGuesses:
        """feature [1, hidden], logits [1, reduced] -> the k most probable tokens as target ids."""
        top = torch.softmax(logits[0].float(), dim=-1).topk(min(k, logits.shape[-1]))  # [k] each
        token_ids = self._proposer.drafter.vocab_ids[top.indices]  # [k]
        return HeadGuesses(feature, tuple(int(t) for t in token_ids), tuple(float(p) for p in top.values))

    def propose(self, max_tokens: int) -> Proposal:
        if self._closed:
            raise RuntimeError("draft session used after close")
        first = self._step_from_feature() if max_tokens > 0 else None
        if first is None:
            return Proposal()  # the block still commits one token and brings the feature
        device = self._proposer.device
        token = self._tokens[-1]
        tokens: list[int] = []
        dists: list[SparseDist] = []
        sources: list[str] = []
        with torch.inference_mode():
            for depth in range(max_tokens):
                if depth == 0:
                    feature, logits = first  # [1, hidden], [1, reduced]
                else:
                    token_ids = torch.tensor([token], dtype=torch.long, device=device)  # [1]
                    feature, logits = self._step(feature, token_ids)  # [1, hidden], [1, reduced]
                token, dist = self._pick(logits[0])
                tokens.append(token)
                self.remember(tokens, feature)
                if dist is not None:
                    dists.append(dist)
                confidence = _top(logits[0])[0]
                sources.append(confidence_source(HEAD_SOURCE, confidence))
                # Stop where the head doubts its own next step: drafts past here are rarely
                # accepted, and each one widens the target's pass.
                if confidence < self._proposer.min_confidence and len(tokens) < max_tokens:
                    break
        return Proposal(tuple(tokens), tuple(dists), tuple(sources))

    def remember(self, drafts: Sequence[int], feature: torch.Tensor) -> None:
        """Records the feature [1, hidden] the head predicted for the position before ``drafts[-1]``
        (the one that produced it), ``drafts`` following the committed sequence: should they be
        taken as committed without a verdict, the head drafts on from there at no extra step."""
        self._rollout.remember(self._tokens, drafts, feature)

    def commit(self, base_len: int, token_ids: Sequence[int], hidden_states: torch.Tensor | None = None) -> None:
        """A verdict's hidden states bring the target's feature. Without them (tokens taken as
        committed before a verdict: a pipelined block's assumption, or a roll back to the last
        verdict), the head rolls its own features from the last verdict's, as it does inside a
        block (``draft_service.proposers.rollout``)."""
        if not 0 <= base_len <= len(self._tokens):
            raise ValueError(f"base_len {base_len} outside the committed sequence of {len(self._tokens)}")
        if base_len + len(token_ids) == 0:
            raise ValueError("the committed sequence cannot become empty")
        if base_len == len(self._tokens) and not token_ids:  # a refused block: nothing moved
            return
        self._first_step = None
        del self._tokens[base_len:]
        self._tokens.extend(token_ids)
        if self._shaped is not None:
            self._shaped.commit(self._tokens)
        self._rollout.changed_from(base_len)
        # A verdict's states must be [len(token_ids), hidden]: a target that sends another shape
        # (with as many bytes) gets no step on them, the next block is empty.
        expected = (len(token_ids), self._proposer.drafter.config.hidden_size)
        if token_ids and hidden_states is not None and tuple(hidden_states.shape) == expected:
            # [hidden]: the state whose logits produced the last committed token.
            self._feature = hidden_states[-1].detach().float().clone()
            self._feature_len = len(self._tokens)
            self._rollout.anchor(self._tokens, self._feature)
            return
        if hidden_states is not None:
            log.warning(
                "verdict of %d token(s) came with hidden states of shape %s, not %s; the next block is empty",
                len(token_ids), tuple(hidden_states.shape), expected,
            )
        self._feature = self._rollout.roll(self._tokens) if hidden_states is None else None
        self._feature_len = len(self._tokens) if self._feature is not None else -1

    def close(self) -> None:
        self._closed = True
        self._feature = None
        self._first_step = None
        self._rollout.clear()
        self._tokens = []

    def _step_from_feature(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The head's step from the current feature and the last committed token (kept until the
        next commit), or None without a current feature."""
        if not self.has_feature:
            return None
        if self._first_step is None:
            device = self._proposer.device
            token_ids = torch.tensor([self._tokens[-1]], dtype=torch.long, device=device)  # [1]
            with torch.inference_mode():
                self._first_step = self._step(self._feature.to(device)[None], token_ids)
        return self._first_step

    def _step(self, features: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's step (features [b, hidden], tokens [b] -> features [b, hidden], logits [b, reduced]),
        its logits shaped as the target's are where the session has penalties or a bias."""
        predicted, logits = self._proposer.drafter.step(features, token_ids)  # [b, hidden], [b, reduced]
        return predicted, logits if self._shaped is None else self._shaped.apply(logits)

    def _pick(self, logits: torch.Tensor) -> tuple[int, SparseDist | None]:
        """A draft token (target id) from the logits over the reduced vocabulary [reduced]."""
        vocab_ids = self._proposer.drafter.vocab_ids
        if self._sampler is None:
            return int(vocab_ids[int(torch.argmax(logits))]), None
        return self._sampler.sample(logits, vocab_ids)


def _described(embed: torch.Tensor | QuantizedTensor) -> str:
    """How the target embedding is held, for the load's log line."""
    if isinstance(embed, QuantizedTensor):
        return f"on its {embed.source} blocks"
    return str(embed.dtype).removeprefix("torch.")


def _top(logits: torch.Tensor) -> tuple[float, int]:
    """The head's most likely reduced index and the probability it gives it (logits: [reduced])."""
    probability, index = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    return float(probability), int(index)


class EagleProposer(Proposer):
    """A loaded head plus the target tensors it borrows, shared by every session."""

    kind = "eagle"

    def __init__(
        self,
        drafter: EagleDrafter,
        *,
        name: str,
        device: str = "cpu",
        draft_top_k: int = 32,
        min_confidence: float = 0.0,
        acceptance_prior: AcceptancePrior | None = None,
    ) -> None:
        if draft_top_k < 1:
            raise ValueError(f"draft_top_k must be >= 1, got {draft_top_k}")
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.min_confidence = min_confidence
        self.drafter = drafter
        self.device = torch.device(device)
        self.draft_top_k = draft_top_k
        self._name = name
        self._prior = acceptance_prior

    @classmethod
    def load(
        cls,
        head_dir: Path,
        target_hf_dir: Path,
        target: TargetInfo,
        *,
        device: str = "cpu",
        embed_dtype: torch.dtype | None = torch.bfloat16,
        draft_top_k: int = 32,
        min_confidence: float = 0.0,
        dtype: torch.dtype = torch.bfloat16,
        vocab_limit: int = 0,
        kernel: QuantKernel | None = None,
    ) -> EagleProposer:
        """Loads a head directory and the target's embedding and reduced LM-head rows.

        Checks the head against the target's Info first, before reading the large embedding
        ([target vocab, hidden]). A converted GGUF target's own blocks of it serve where they are
        (on a CPU; its exact values in a quarter of float32's bytes); otherwise it is kept in
        ``embed_dtype``, bf16 by default: half the memory, and the head RMS-normalises the rows it
        looks up, so the rounding is immaterial. ``dtype`` and
        ``vocab_limit`` are the drafter's (``tandem.models.eagle.EagleDrafter``): steps in bf16 over the
        most frequent ``vocab_limit`` tokens of the head's vocabulary (0 = all of it), or with a
        quantized ``kernel`` on Q8_0 blocks of the head's weights and rows. A head
        directory may hold ``acceptance.json``, how its drafts (and lookup's beside them) were
        accepted where it was measured: the block-length policy starts from it.
        """
        started = time.perf_counter()
        head_dir = Path(head_dir)
        head, vocab_ids = load_head(head_dir)
        config = head.config
        check_head_fits_target(config, head_dir.name, target)
        if int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= target.vocab_size:
            raise IncompatibleDraftError(
                f"eagle head {head_dir.name!r} maps its reduced vocabulary to ids outside the target's "
                f"vocabulary of {target.vocab_size}"
            )
        prior_file = head_dir / ACCEPTANCE_FILE
        prior = load_prior(prior_file) if prior_file.is_file() else None
        tensors = load_target_tensors(target_hf_dir, config, vocab_ids)
        # A converted GGUF's own blocks of the embedding: its exact values, in a quarter of float32's bytes.
        embed = cached_embedding(target_hf_dir, tensors.embed) if device == "cpu" else None
        if embed is None:
            embed = (tensors.embed if embed_dtype is None else tensors.embed.to(embed_dtype)).to(device)
        drafter = EagleDrafter(
            head.to(device),
            vocab_ids.to(device),
            TargetTensors(embed=embed, head_rows=tensors.head_rows.to(device)),
            dtype=dtype,
            vocab_limit=vocab_limit,
            kernel=kernel,
        )
        log.info(
            "eagle head %s loaded in %.1fs (draft vocabulary %d of the head's %d and the target's %d, steps in %s, "
            "target embedding %s on %s; %s)",
            head_dir, time.perf_counter() - started, drafter.vocab_ids.numel(), vocab_ids.numel(),
            config.target_vocab_size, drafter.weights, _described(embed), device,
            f"acceptance prior of {len(prior)} rates" if prior else "no acceptance prior",
        )
        return cls(
            drafter,
            name=f"eagle:{head_dir.name}",
            device=device,
            draft_top_k=draft_top_k,
            min_confidence=min_confidence,
            acceptance_prior=prior,
        )

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def acceptance_prior(self) -> AcceptancePrior | None:
        return self._prior

    @property
    def tokenizer_fingerprint(self) -> str:
        """The target's fingerprint the head was trained with (checked against the target at start)."""
        return self.drafter.config.target_fingerprint

    @property
    def wants_hidden_states(self) -> bool:
        return True

    def new_session(self, token_ids: Sequence[int], sampling: SamplingParams,
                    shaping: LogitShaping | None = None) -> EagleSession:
        return EagleSession(self, token_ids, sampling, shaping)

    def warm_up(self) -> None:
        """Drafts greedily and by sampling from a made-up feature: a fresh session's first
        proposal is empty, so the base warm-up would never run the head."""
        hidden = torch.zeros(1, self.drafter.config.hidden_size)  # [1, hidden]
        for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=0)):
            session = self.new_session(WARMUP_TOKENS, sampling)
            try:
                session.propose(4)
                session.commit(len(WARMUP_TOKENS), (WARMUP_TOKENS[0],), hidden)
                session.propose(4)
            finally:
                session.close()
