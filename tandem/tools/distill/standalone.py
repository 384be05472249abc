"""The ``standalone`` kind: a small causal LM over the reduced vocabulary, distilled on the target's choices.

It needs no target features at draft time, which makes it the fallback where features cannot
travel; but it knows only what its own few layers learn, so it agrees with the target far less
often than the eagle head. Its vocabulary is the reduced set (index i -> target id
``vocab_ids[i]``; target ids outside the set are fed as index 0, the target's unk token), so it
does not carry the target's huge embedding and head.

Saved as a Hugging Face directory: config.json + model.safetensors, the target's tokenizer files
(so the tokenizer fingerprint matches the target's) and ``tandem_vocab_ids.safetensors``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.tools.distill.soft_loss import soft_cross_entropy

VOCAB_FILE = "tandem_vocab_ids.safetensors"


@dataclass
class StandaloneConfig:
    layers: int = 2
    width: int = 256
    heads: int = 4
    batch: int = 8  # sequences per optimizer step


def build_model(config: StandaloneConfig, reduced: int, max_positions: int, specials: dict[str, int | None]) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=reduced, hidden_size=config.width, intermediate_size=config.width * 3,
        num_hidden_layers=config.layers, num_attention_heads=config.heads, num_key_value_heads=max(config.heads // 2, 1),
        head_dim=config.width // config.heads, max_position_embeddings=max_positions, tie_word_embeddings=True,
        bos_token_id=specials.get("bos"), eos_token_id=specials.get("eos"), pad_token_id=specials.get("pad"),
    )
    return LlamaForCausalLM(hf_config)


def to_reduced_inputs(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Target ids [..] -> reduced indices [..]; ids outside the set become 0 (the unk slot)."""
    return table[tokens.long()].clamp(min=0)


def make_step_fn(model: Any, data: dict[str, torch.Tensor], table: torch.Tensor, config: StandaloneConfig,
                 seed: int, device: str):
    inputs = to_reduced_inputs(data["tokens"], table).to(device)  # [n, L]
    valid = data["valid"].bool().to(device)
    topk_reduced = table[data["topk_ids"].long()].to(device)  # [n, L, k]
    topk_lp = data["topk_logprobs"].to(device)
    n_seq = inputs.shape[0]

    def step_fn(step: int) -> tuple[torch.Tensor, int, float]:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randint(n_seq, (min(config.batch, n_seq),), generator=gen).to(device)
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
            logits = model(input_ids=inputs[idx]).logits  # [b, L, reduced]; causal, so right padding is harmless
        mask = valid[idx]
        loss, hit = soft_cross_entropy(logits[mask], topk_reduced[idx][mask], topk_lp[idx][mask])
        return loss, int(mask.sum()), float(hit.float().mean())

    return step_fn


@torch.inference_mode()
def rollout_hits(model: Any, vocab_ids: torch.Tensor, table: torch.Tensor, data: dict[str, torch.Tensor], steps: int,
                 device: str, batch: int = 8) -> torch.Tensor:
    """hits [seqs, L - steps, steps]: teacher-forced prediction at t+j-1 == target argmax at t+j.

    Along a window whose inputs are the target's choices, teacher forcing is exactly what the draft
    sees after accepting, so the same rollout statistics apply.
    """
    model.eval()
    argmax = data["topk_ids"][..., 0].long()
    out = []
    for start in range(0, data["tokens"].shape[0], batch):
        inputs = to_reduced_inputs(data["tokens"][start : start + batch], table).to(device)
        pred = vocab_ids.to(device)[model(input_ids=inputs).logits.argmax(-1)].cpu()  # [b, L] target ids for next
        hit = pred == argmax[start : start + batch]  # [b, L]: prediction at p matches the target at p
        n = inputs.shape[1] - steps
        out.append(torch.stack([hit[:, j : j + n] for j in range(1, steps + 1)], dim=-1))
    return torch.cat(out)


def save(output: Path, model: Any, tokenizer: Any, vocab_ids: torch.Tensor) -> None:
    from safetensors.torch import save_file

    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    save_file({"vocab_ids": vocab_ids.to(torch.int64).contiguous()}, str(output / VOCAB_FILE))
