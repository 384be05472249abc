"""A Hugging Face draft model (``hf``): any SPEC ``tandem.models.load_model`` accepts.

Each session keeps its own KV cache. After a verdict the cache is cropped back to the longest
prefix the target committed, so the next proposal feeds only the tokens the draft has not seen
(the recovered or bonus token, plus any accepted token it had not fed yet) instead of re-reading
the whole sequence.

The cache is a ``DynamicCache()`` built without the model config on purpose: with a config,
sliding-window layers (Gemma 3) keep only the last window of keys, and cropping such a layer
cannot bring back the keys a rollback needs. A config-less cache keeps every layer's full history;
the model still applies its sliding-window mask, so outputs are unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from draft_service.proposers.base import Proposer, ProposerSession
from draft_service.types import Proposal, SamplingConfig, SparseDist
from tandem.models import LoadedModel, tokenizer_fingerprint


def draft_seed(seed: int) -> int:
    """The draft's generator seed for a session seed.

    Derived rather than reused: the target seeds its own generator from the same session seed, and
    if the draft's samples and the target's acceptance uniforms came from identical streams they
    would be correlated, which breaks the exactness of rejection sampling.
    """
    digest = hashlib.sha256(f"tandem-draft:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TopKSampler:
    """Samples a draft token from the renormalised top-k of the tempered logits and returns q.

    q is exactly sparse (zero outside the kept ids), so the target's rejection sampling is exact
    with it and it stays small on the wire. The session's own top_k / top_p narrow q further when
    set: tokens the target can never produce would only be rejected.
    """

    def __init__(self, sampling: SamplingConfig, draft_top_k: int) -> None:
        if sampling.temperature <= 0:
            raise ValueError("TopKSampler needs a positive temperature; greedy drafts use argmax")
        self.temperature = sampling.temperature
        self.top_k = min(draft_top_k, sampling.top_k) if sampling.top_k > 0 else draft_top_k
        self.top_p = sampling.top_p if 0.0 < sampling.top_p < 1.0 else 1.0
        self.generator = torch.Generator(device="cpu")
        if sampling.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(draft_seed(sampling.seed))

    def sample(self, logits: torch.Tensor) -> tuple[int, SparseDist]:
        """logits: [vocab] (already limited to ids the target accepts)."""
        k = min(self.top_k, logits.shape[-1])
        values, ids = torch.topk(logits.float() / self.temperature, k)  # [k], [k], descending
        probs = torch.softmax(values.cpu(), dim=-1)  # [k]: the top-k renormalised
        ids = ids.cpu()
        if self.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            keep = (torch.cumsum(probs, dim=-1) - probs) < self.top_p  # [k]
            probs, ids = probs[keep], ids[keep]
        nonzero = probs > 0  # masked (-inf) logits that topk still returned
        probs, ids = probs[nonzero], ids[nonzero]
        probs = probs / probs.sum()
        choice = int(torch.multinomial(probs, 1, generator=self.generator))
        dist = SparseDist(tuple(int(i) for i in ids), tuple(float(p) for p in probs))
        return int(ids[choice]), dist


class HfSession(ProposerSession):
    """One session's draft KV cache, kept equal to a prefix of the committed sequence.

    Invariant between calls: ``cached == committed[:len(cached)]`` and at least one committed
    token is not in the cache yet (feeding it yields the logits of the next position).
    """

    def __init__(self, proposer: HfProposer, token_ids: Sequence[int], sampling: SamplingConfig) -> None:
        if not token_ids:
            raise ValueError("a draft session needs at least one committed token")
        self._proposer = proposer
        self._committed: list[int] = list(token_ids)
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
        with torch.inference_mode():
            logits = self._feed(self._committed[len(self._cached) :])
            for position in range(k):
                token, dist = self._pick(logits)
                tokens.append(token)
                if dist is not None:
                    dists.append(dist)
                if position + 1 < k:
                    logits = self._feed([token])
        return Proposal(tuple(tokens), tuple(dists))

    def commit(self, base_len: int, token_ids: Sequence[int]) -> None:
        if not 0 <= base_len <= len(self._committed):
            raise ValueError(f"base_len {base_len} outside the committed sequence of {len(self._committed)}")
        if base_len + len(token_ids) == 0:
            raise ValueError("the committed sequence cannot become empty")
        committed = self._committed
        del committed[base_len:]
        committed.extend(token_ids)
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
        """Runs the draft over new tokens; returns the next-token logits, [vocab_limit]."""
        if self._cache is None:
            raise RuntimeError("draft session used after close")
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self._proposer.device)  # [1, n]
        out = self._proposer.model(input_ids=input_ids, cache=self._cache, use_cache=True, logits_to_keep=1)
        self._cached.extend(token_ids)
        return out.logits[0, -1, : self._proposer.vocab_limit]  # [vocab_limit]

    def _pick(self, logits: torch.Tensor) -> tuple[int, SparseDist | None]:
        if self._sampler is None:
            return int(torch.argmax(logits)), None
        return self._sampler.sample(logits)


class HfProposer(Proposer):
    """A transformers causal LM as the drafter.

    ``vocab_limit`` is the target's vocabulary size: a draft with padded embeddings has logits for
    ids the target does not have, and those must never be proposed.
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
        self.vocab_limit = min(draft_vocab, vocab_limit) if vocab_limit else draft_vocab
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

    def new_session(self, token_ids: Sequence[int], sampling: SamplingConfig) -> HfSession:
        return HfSession(self, token_ids, sampling)
