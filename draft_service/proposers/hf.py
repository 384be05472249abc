"""A Hugging Face draft model (``hf``): any SPEC ``tandem.models.load_model`` accepts.

Each session keeps its own KV cache. After a verdict the cache is cropped back to the longest
prefix the target committed, so the next proposal feeds only the tokens the draft has not seen
(the recovered or bonus token, plus any accepted token it had not fed yet) instead of re-reading
the whole sequence.

The cache is a ``DynamicCache()`` built without the model config on purpose: with a config,
sliding-window layers (Gemma 3) keep only the last window of keys, and cropping such a layer
cannot bring back the keys a rollback needs. A config-less cache keeps every layer's full history;
the model still applies its sliding-window mask, so outputs are unchanged.

A distilled draft may have a reduced vocabulary (``tandem distill`` keeps the rows of the tokens
the target emits most, which makes a small draft's embedding and head far smaller). Its directory
then holds ``tandem_vocab_ids.safetensors`` (``vocab_ids`` [reduced] int64: reduced index i is
target id ``vocab_ids[i]``). The session keeps target ids everywhere and translates only at the
model's edges: committed ids are fed as reduced ids (ids outside the set as index 0, the draft
has no row for them) and drafted ids and q's support are mapped back to target ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from draft_service.block_length import confidence_source
from draft_service.proposers.base import Proposer, ProposerSession
from draft_service.proposers.sampling import TopKSampler
from draft_service.proposers.shaping import ShapedLogits
from draft_service.types import LogitShaping, Proposal, SamplingParams, SparseDist
from tandem.models import LoadedModel, tokenizer_fingerprint

VOCAB_IDS_FILE = "tandem_vocab_ids.safetensors"
MODEL_SOURCE = "model"  # Proposal.sources: "model:0.7", a draft the model gave 70 to 80%


class VocabMap:
    """Reduced draft vocabulary <-> target ids.

    ``vocab_ids`` [reduced] int64: reduced index -> target id. Target ids outside the set map to
    reduced index 0 (fed to the draft only; the draft never proposes them).
    """

    def __init__(self, vocab_ids: torch.Tensor) -> None:
        if vocab_ids.dim() != 1 or vocab_ids.numel() == 0:
            raise ValueError(f"vocab_ids must be a non-empty 1-d tensor, got shape {tuple(vocab_ids.shape)}")
        self.vocab_ids = vocab_ids.to(torch.long).cpu()  # [reduced]
        if int(self.vocab_ids.min()) < 0 or len(set(self.vocab_ids.tolist())) != self.vocab_ids.numel():
            raise ValueError("vocab_ids must be distinct non-negative target ids")
        self._to_reduced = torch.zeros(int(self.vocab_ids.max()) + 1, dtype=torch.long)  # [max id + 1]
        self._to_reduced[self.vocab_ids] = torch.arange(self.vocab_ids.numel())

    @classmethod
    def of_checkpoint(cls, hf_dir: Path) -> VocabMap | None:
        """The map a draft checkpoint ships (``tandem_vocab_ids.safetensors``), or None."""
        path = Path(hf_dir) / VOCAB_IDS_FILE
        if not path.is_file():
            return None
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        if "vocab_ids" not in tensors:
            raise ValueError(f"{path} has no tensor 'vocab_ids'")
        return cls(tensors["vocab_ids"])

    @property
    def size(self) -> int:
        return self.vocab_ids.numel()

    def to_reduced(self, target_ids: Sequence[int]) -> list[int]:
        table = self._to_reduced
        return [int(table[t]) if 0 <= t < table.numel() else 0 for t in target_ids]

    def to_target(self, reduced_id: int) -> int:
        return int(self.vocab_ids[reduced_id])


class HfSession(ProposerSession):
    """One session's draft KV cache, kept equal to a prefix of the committed sequence.

    Invariant between calls: ``cached == committed[:len(cached)]`` and at least one committed
    token is not in the cache yet (feeding it yields the logits of the next position).
    """

    def __init__(self, proposer: HfProposer, token_ids: Sequence[int], sampling: SamplingParams,
                 shaping: LogitShaping | None = None) -> None:
        if not token_ids:
            raise ValueError("a draft session needs at least one committed token")
        self._proposer = proposer
        self._committed: list[int] = list(token_ids)
        # The target's penalties and bias, applied to every step's logits (draft_service.proposers.shaping).
        self._shaped = None
        if shaping is not None and shaping.active:
            self._shaped = ShapedLogits(shaping, proposer.scored_ids)
            self._shaped.commit(self._committed)
        self._cache: DynamicCache | None = DynamicCache()
        self._cached: list[int] = []  # the ids whose keys/values are in the cache, in order
        self._sampler = None if sampling.greedy else TopKSampler(sampling, proposer.draft_top_k)

    @property
    def cached_len(self) -> int:
        return len(self._cached)

    def propose(self, max_tokens: int) -> Proposal:
        k = min(max_tokens, self._proposer.room_after(len(self._committed)))
        if k <= 0:
            return Proposal()
        if len(self._cached) >= len(self._committed):
            self.commit(len(self._committed), ())  # a proposal nobody committed: drop its tokens
        tokens: list[int] = []
        dists: list[SparseDist] = []
        sources: list[str] = []
        with torch.inference_mode():
            logits = self._feed(self._committed[len(self._cached) :])
            for position in range(k):
                token, dist = self._pick(logits)
                tokens.append(token)
                if dist is not None:
                    dists.append(dist)
                # The top probability, without a vocabulary-sized softmax: exp(max - logsumexp).
                confidence = float(torch.exp(logits.max().float() - torch.logsumexp(logits.float(), dim=-1)))
                sources.append(confidence_source(MODEL_SOURCE, confidence))
                if position + 1 < k:
                    logits = self._feed([token])
        return Proposal(tuple(tokens), tuple(dists), tuple(sources))

    def next_tokens(self, n: int) -> tuple[int, ...]:
        """The draft's top-``n`` after the committed sequence (one forward step, kept in the cache)."""
        if n <= 0 or self._proposer.room_after(len(self._committed)) <= 0:
            return ()
        if len(self._cached) >= len(self._committed):
            self.commit(len(self._committed), ())  # the last token is fed again for its logits
        with torch.inference_mode():
            logits = self._feed(self._committed[len(self._cached) :])  # [vocab_limit]
        top = torch.topk(logits, min(n, logits.shape[-1])).indices.tolist()
        vocab = self._proposer.vocab_map
        return tuple(vocab.to_target(t) if vocab is not None else t for t in top)

    def commit(self, base_len: int, token_ids: Sequence[int], hidden_states: torch.Tensor | None = None) -> None:
        if not 0 <= base_len <= len(self._committed):
            raise ValueError(f"base_len {base_len} outside the committed sequence of {len(self._committed)}")
        if base_len + len(token_ids) == 0:
            raise ValueError("the committed sequence cannot become empty")
        committed = self._committed
        del committed[base_len:]
        committed.extend(token_ids)
        if self._shaped is not None:
            self._shaped.commit(committed)
        # committed[:base_len] did not change, so the cache agrees with it up to there; past
        # base_len it holds the last proposal, which agrees as far as the target accepted it.
        keep = min(base_len, len(self._cached))
        while keep < len(self._cached) and keep < len(committed) and self._cached[keep] == committed[keep]:
            keep += 1
        keep = min(keep, len(committed) - 1)
        if keep < len(self._cached):
            if self._cache is None:
                raise RuntimeError("draft session used after close")
            self._cache.crop(keep - len(self._cached))  # negative: removes that many positions
            del self._cached[keep:]

    def close(self) -> None:
        self._cache = None
        self._cached = []

    def _feed(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Runs the draft over new tokens; returns the next-token logits, [vocab_limit], shaped as
        the target's are where the session has penalties or a bias."""
        if self._cache is None:
            raise RuntimeError("draft session used after close")
        vocab = self._proposer.vocab_map
        fed = vocab.to_reduced(token_ids) if vocab is not None else list(token_ids)
        input_ids = torch.tensor([fed], dtype=torch.long, device=self._proposer.device)  # [1, n]
        out = self._proposer.model(input_ids=input_ids, cache=self._cache, use_cache=True, logits_to_keep=1)
        self._cached.extend(token_ids)
        logits = out.logits[0, -1, : self._proposer.vocab_limit]  # [vocab_limit]
        return logits if self._shaped is None else self._shaped.apply(logits[None])[0]

    def _pick(self, logits: torch.Tensor) -> tuple[int, SparseDist | None]:
        """A draft token (target id) from the logits over the draft's (maybe reduced) vocabulary."""
        vocab = self._proposer.vocab_map
        if self._sampler is None:
            token = int(torch.argmax(logits))
            return (vocab.to_target(token) if vocab is not None else token), None
        return self._sampler.sample(logits, vocab.vocab_ids if vocab is not None else None)


class HfProposer(Proposer):
    """A transformers causal LM as the drafter.

    ``vocab_limit`` is the target's vocabulary size: a draft with padded embeddings has logits for
    ids the target does not have, and those must never be proposed. A reduced-vocabulary draft
    (``VocabMap``) proposes only its mapped ids, which must all be below ``vocab_limit``.
    """

    kind = "hf"

    def __init__(self, loaded: LoadedModel, *, vocab_limit: int | None = None, draft_top_k: int = 32) -> None:
        if draft_top_k < 1:
            raise ValueError(f"draft_top_k must be >= 1, got {draft_top_k}")
        self.model: Any = loaded.model
        self.device = torch.device(loaded.device)
        self.draft_top_k = draft_top_k
        self._name = loaded.name
        self._fingerprint = tokenizer_fingerprint(loaded.tokenizer)
        draft_vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self.vocab_map = VocabMap.of_checkpoint(loaded.hf_dir)
        if self.vocab_map is None:
            self.vocab_limit = min(draft_vocab, vocab_limit) if vocab_limit else draft_vocab
        else:  # logits are over reduced indices; every mapped id must exist in the target
            biggest = int(self.vocab_map.vocab_ids.max())
            if vocab_limit and biggest >= vocab_limit:
                raise ValueError(
                    f"draft {loaded.name!r} maps its vocabulary to target id {biggest}, beyond the target's "
                    f"vocabulary of {vocab_limit}"
                )
            self.vocab_limit = min(draft_vocab, self.vocab_map.size)
        # [vocab_limit] the target id each logit scores (a session's shaping is indexed by them)
        mapped = self.vocab_map
        self.scored_ids = (torch.arange(self.vocab_limit) if mapped is None else mapped.vocab_ids[: self.vocab_limit]).to(
            self.device)
        self._max_positions: int | None = getattr(self.model.config, "max_position_embeddings", None)

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def tokenizer_fingerprint(self) -> str:
        return self._fingerprint

    def room_after(self, committed_len: int) -> int:
        """How many tokens the draft can propose after ``committed_len`` tokens.

        Proposing k tokens places the last fed one at position committed_len + k - 2, which must
        stay inside the draft's positions; past that the target continues alone (empty blocks).
        """
        if self._max_positions is None:
            return 1 << 30
        return self._max_positions - committed_len + 1

    def new_session(self, token_ids: Sequence[int], sampling: SamplingParams,
                    shaping: LogitShaping | None = None) -> HfSession:
        return HfSession(self, token_ids, sampling, shaping)
