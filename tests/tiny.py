"""Tiny random-weight Hugging Face checkpoints, written to folders so the real loading code runs.

All tiny models share one small byte-level BPE tokenizer (vocab ~300), so a draft and a target made
here are compatible; different seeds give different weights.
"""

from __future__ import annotations

from pathlib import Path

_CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    '{"name": "tandem", "version": 1, "items": [1, 2, 3]}\n',
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "héllo wörld ✓ 日本語 emoji 🙂\n",
]


def make_tokenizer(folder: Path, vocab_size: int = 300):
    """A byte-level BPE tokenizer with <bos>/<eos>/<pad>, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(folder)
    return fast


def make_tiny_model(
    folder: Path,
    seed: int = 0,
    arch: str = "llama",
    sliding_window: int = 8,
    hidden_size: int = 32,
    num_layers: int = 2,
    max_position_embeddings: int = 2048,
    tokenizer_from: Path | None = None,
    tokenizer_vocab_size: int = 300,
) -> Path:
    """Writes a random-weight causal LM + the shared tiny tokenizer into ``folder``.

    ``arch="gemma3"`` gives Gemma 3 layers with a sliding window on all but every third layer,
    so rollback past the window is exercised with short prompts. ``tokenizer_from`` copies another
    checkpoint's tokenizer instead (e.g. to build a random draft for the real default target).
    """
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_from))
        tokenizer.save_pretrained(folder)
    else:
        tokenizer = make_tokenizer(folder, vocab_size=tokenizer_vocab_size)
    vocab = len(tokenizer)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        config = LlamaConfig(**common)
    elif arch == "gemma3":
        from transformers import Gemma3TextConfig

        layer_types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)]
        config = Gemma3TextConfig(**common, sliding_window=sliding_window, layer_types=layer_types)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform logits; sharpen them so greedy/argmax is well separated
    # and sampling tests see a non-trivial distribution.
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0) if param.dim() > 1 else None
    model.save_pretrained(folder)
    return folder
