"""Running the target to collect what a draft is distilled on: features, top-k choices, generations.

The labels are always the target's own next-token choices and distributions, never the text's next
tokens: on offline text the target is teacher-forced over the text, on templated prompts it first
generates greedily (batched, left padded: far cheaper per token than batch 1) and is then
teacher-forced over prompt + generation, so those positions are exactly what a draft sees while
serving a greedy session.

The job stream is deterministic (seeded): job i is a generation batch or a batch of offline chunks,
held-out jobs come first. A resumed run rebuilds the stream and skips the jobs the cache has.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from tandem.tools.distill.corpus import generation_prompts, offline_documents
from tandem.tools.distill.store import SOURCES, FeatureStore


@dataclass
class CollectConfig:
    seq_len: int = 256  # positions per stored sequence
    topk: int = 8  # target choices kept per position (for the soft loss)
    batch: int = 8  # offline chunks per target forward
    gen_batch: int = 16  # prompts per batched greedy generation
    gen_new_tokens: int = 128
    gen_every: int = 4  # one generation job every gen_every jobs
    code_prefix_share: float = 0.5  # of generation prompts: stdlib function openings instead of templates
    prose_share: float = 0.0  # of generation prompts: prose openings (distill/prose.py) instead of templates
    sampled_share: float = 0.0  # of generation jobs: openings the target samples itself from BOS (see Job)
    sampled_tokens: int = 24  # tokens each such opening is sampled for (temperature 1) before greedy decoding
    chunks_per_doc: int = 4  # at most this many chunks of one document (diversity under a time budget)
    heldout_gen_batches: int = 1  # held-out generation jobs, collected first
    heldout_batches: int = 2  # held-out offline jobs, collected next
    head_rows_per_pass: int = 256  # positions per full-vocabulary LM head product (memory bound)
    gen_dtype: str = "float32"  # dtype of the generation copy (bfloat16 halves a CPU's memory traffic)


@dataclass
class Job:
    heldout: bool
    sequences: list[list[int]] | None = None  # offline chunks (BOS first)
    sources: list[int] | None = None
    prompts: list[str] | None = None  # generation job
    sampled: int = 0  # tokens sampled from the target before its greedy continuation (prompts are then empty)
    seed: int = 0  # of those draws


class TargetRunner:
    """The target model in inference mode: teacher-forced features + top-k, and greedy generation."""

    def __init__(self, loaded: Any, config: CollectConfig) -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.config = config
        self.body = self.model.get_decoder()
        self.head_weight = self.model.get_output_embeddings().weight  # [vocab, hidden]
        text_config = getattr(self.model.config, "get_text_config", lambda: self.model.config)()
        self.softcap = getattr(text_config, "final_logit_softcapping", None)
        self.bos = self.tokenizer.bos_token_id
        self.eos = self.tokenizer.eos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (self.eos or 0)
        self.head_bf16 = self.head_weight.detach().to(torch.bfloat16)  # [vocab, hidden] candidate finder
        self.gen_model = None
        if config.gen_dtype != "float32":
            import copy

            self.gen_model = copy.deepcopy(self.model).to(getattr(torch, config.gen_dtype)).eval()

    def top_choices(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [r, hidden] float32 -> (top-k target ids [r, k], their log-probs [r, k]), argmax first.

        The full-vocabulary product is most of the target's cost. It runs in bfloat16 (faster on a
        CPU with bf16 units; docs/distill.md#distill) only to find candidates and the
        normaliser; the candidates are then scored again in float32, so the stored choices and their
        order are the float32 target's (the top-k of the float32 logits lies inside the bf16
        top-``candidates`` unless bf16 rounding moved a logit by more than the gap, which 32
        candidates make vanishingly rare).
        """
        k = self.config.topk
        cap = self.softcap
        approx = (rows.to(self.head_bf16.dtype) @ self.head_bf16.T).float()  # [r, vocab]
        if cap:
            approx = torch.tanh(approx / cap) * cap
        lse = torch.logsumexp(approx, dim=-1, keepdim=True)  # [r, 1]
        cand = approx.topk(max(4 * k, 32), dim=-1).indices  # [r, c]
        del approx
        exact = torch.einsum("rh,rch->rc", rows, self.head_weight[cand].float())  # [r, c] float32 logits
        if cap:
            exact = torch.tanh(exact / cap) * cap
        values, order = exact.topk(k, dim=-1)
        return cand.gather(-1, order), values - lse

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ([self.bos] if self.bos is not None else []) + list(ids)

    @torch.inference_mode()
    def teacher(self, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
        """Right-padded batch -> features, top-k ids and log-probs, padded to seq_len."""
        n, length, k = len(sequences), self.config.seq_len, self.config.topk
        width = max(len(s) for s in sequences)
        ids = torch.full((n, width), self.pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, seq in enumerate(sequences):
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
        out = self.body(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        hidden = out.last_hidden_state  # [n, width, hidden]
        flat = hidden[mask.bool().to(self.device)]  # [m, hidden] real positions only
        top_ids, top_lp = [], []
        for start in range(0, flat.shape[0], self.config.head_rows_per_pass):
            ids_part, lp_part = self.top_choices(flat[start : start + self.config.head_rows_per_pass].float())
            top_ids.append(ids_part.cpu())
            top_lp.append(lp_part.cpu())
        hsize = hidden.shape[-1]
        features = torch.zeros((n, length, hsize), dtype=torch.float16)
        topk_ids = torch.zeros((n, length, k), dtype=torch.int32)
        topk_lp = torch.full((n, length, k), -1e4, dtype=torch.float16)
        valid = torch.zeros((n, length), dtype=torch.uint8)
        tokens = torch.full((n, length), self.pad, dtype=torch.int32)
        sel = torch.zeros((n, length), dtype=torch.bool)
        sel[:, :width] = mask.bool()
        features[sel] = flat.to("cpu", torch.float16)
        topk_ids[sel] = torch.cat(top_ids).to(torch.int32)
        topk_lp[sel] = torch.cat(top_lp).to(torch.float16)
        valid[sel] = 1
        tokens[:, :width] = ids.to(torch.int32)
        return {"tokens": tokens, "valid": valid, "features": features, "topk_ids": topk_ids, "topk_logprobs": topk_lp}

    @torch.inference_mode()
    def generate(self, prompts: list[str], sampled: int = 0, seed: int = 0) -> tuple[list[list[int]], list[int]]:
        """Batched greedy generation (left padded, KV cache) -> (prompt + generation token lists, prompt lengths).

        A plain loop rather than ``model.generate``: on a CPU its per-step overhead was several times the
        forward itself. Generation may run in a cheaper dtype (``gen_model``): the text only has to be
        what the target would plausibly write; the labels come from the float32 teacher pass after.
        The first ``sampled`` tokens are drawn at temperature 1 (seeded) and count as the prompt: from
        an empty prompt the target then opens a text of its own choosing, in whatever genre it finds
        likely, which no list of templates covers; its greedy continuation is what a draft sees serving.
        """
        draws = torch.Generator(device=self.device).manual_seed(seed)
        model = self.gen_model if self.gen_model is not None else self.model
        encoded = [self.encode(p)[: self.config.seq_len // 2] for p in prompts]
        n, width = len(encoded), max(len(e) for e in encoded)
        ids = torch.full((n, width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(encoded):
            ids[i, width - len(e) :] = torch.tensor(e)
            mask[i, width - len(e) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        steps = min(self.config.gen_new_tokens, self.config.seq_len - width)
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        generated = []
        finished = torch.zeros(n, dtype=torch.bool, device=self.device)
        for step in range(steps):
            if step < sampled:
                probs = torch.softmax(out.logits[:, -1].float(), dim=-1)  # [n, vocab]
                nxt = torch.multinomial(probs, 1, generator=draws)[:, 0]  # [n]
            else:
                nxt = out.logits[:, -1].argmax(-1)  # [n]
            nxt = torch.where(finished, torch.full_like(nxt, self.pad), nxt)
            generated.append(nxt.cpu())
            if self.eos is not None:
                finished |= nxt == self.eos
            if bool(finished.all()) or step == steps - 1:
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
            out = model(input_ids=nxt[:, None], attention_mask=mask, use_cache=True, **_cache_kwargs(model, out))
        gen_ids = torch.stack(generated, dim=1)  # [n, steps]
        sequences = []
        for i, e in enumerate(encoded):
            gen = gen_ids[i].tolist()
            if self.eos is not None and self.eos in gen:
                gen = gen[: gen.index(self.eos) + 1]
            sequences.append(e + gen)
        return sequences, [min(len(e) + sampled, len(s)) for e, s in zip(encoded, sequences, strict=True)]


def _cache_kwargs(model: Any, out: Any) -> dict[str, Any]:
    """The KV cache of ``out`` as the next forward's keyword (``cache`` in newer transformers)."""
    import inspect

    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": out.cache if hasattr(out, "cache") else out.past_key_values}
    return {"past_key_values": out.past_key_values}


def _chunks(runner: TargetRunner, docs: Iterator, config: CollectConfig) -> Iterator[tuple[list[int], int]]:
    """Documents -> (BOS + up to seq_len-1 tokens, source index), a few chunks per document."""
    body = config.seq_len - (1 if runner.bos is not None else 0)
    for doc in docs:
        ids = runner.tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        for n, start in enumerate(range(0, len(ids), body)):
            piece = ids[start : start + body]
            if n >= config.chunks_per_doc or len(piece) < 16:
                break
            yield ([runner.bos] if runner.bos is not None else []) + list(piece), SOURCES.index(doc.source)


def job_stream(runner: TargetRunner, config: CollectConfig, seed: int) -> Iterator[Job]:
    """Held-out jobs (generation, then offline) first, then training jobs forever."""
    for heldout in (True, False):
        prompts = generation_prompts(seed, heldout, config.code_prefix_share, config.prose_share)
        kinds = random.Random(seed * 7 + 3)  # which training generation jobs sample their own openings
        chunks = _chunks(runner, offline_documents(seed, heldout), config)
        indices = range(config.heldout_gen_batches + config.heldout_batches) if heldout else itertools.count()
        for i in indices:
            is_gen = i < config.heldout_gen_batches if heldout else i % config.gen_every == 0
            if is_gen and not heldout and kinds.random() < config.sampled_share:
                yield Job(heldout, prompts=[""] * config.gen_batch, sampled=config.sampled_tokens, seed=seed * 100003 + i)
            elif is_gen:
                yield Job(heldout, prompts=[next(prompts) for _ in range(config.gen_batch)])
            else:
                batch = list(itertools.islice(chunks, config.batch))
                yield Job(heldout, sequences=[c for c, _ in batch], sources=[s for _, s in batch])


def run_job(runner: TargetRunner, job: Job) -> dict[str, torch.Tensor]:
    length = runner.config.seq_len
    if job.prompts is not None:
        sequences, prompt_lens = runner.generate(job.prompts, job.sampled, job.seed)
        shard = runner.teacher(sequences)
        generated = torch.zeros((len(sequences), length), dtype=torch.uint8)
        for i, (seq, plen) in enumerate(zip(sequences, prompt_lens, strict=True)):
            generated[i, plen : len(seq)] = 1
        shard["generated"] = generated
        shard["source"] = torch.zeros(len(sequences), dtype=torch.uint8)
    else:
        assert job.sequences is not None and job.sources is not None
        shard = runner.teacher(job.sequences)
        shard["generated"] = torch.zeros((len(job.sequences), length), dtype=torch.uint8)
        shard["source"] = torch.tensor(job.sources, dtype=torch.uint8)
    return shard


def collect(runner: TargetRunner, store: FeatureStore, deadline: float, max_tokens: int | None) -> None:
    """Runs jobs until the deadline or the token cap; every job is one shard, so a kill loses one job."""
    config = runner.config
    stream = job_stream(runner, config, store.manifest.seed)
    skip = store.manifest.jobs_done
    bar = tqdm(total=max_tokens, initial=store.train_tokens, unit="tok", desc="collect target features",
               dynamic_ncols=True)
    for index, job in enumerate(stream):
        if index < skip:
            continue
        done = len(store.manifest.heldout_shards) >= config.heldout_gen_batches + config.heldout_batches
        if done and (time.monotonic() >= deadline or (max_tokens is not None and store.train_tokens >= max_tokens)):
            break
        started = time.monotonic()
        shard = run_job(runner, job)
        store.add(shard, job.heldout, time.monotonic() - started)
        if not job.heldout:
            bar.update(int(shard["valid"].sum()))
        bar.set_postfix(jobs=store.manifest.jobs_done, heldout=len(store.manifest.heldout_shards))
    bar.close()
