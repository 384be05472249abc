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


# Block types given to the tiny quantized Gemma's tensors, by GGUF name suffix: every type tandem
# reads, each on at least one tensor (the K types need an inner dimension of 256: hidden_size=256).
TINY_GGUF_TYPES = {
    "token_embd": "Q8_0",
    "attn_q": "Q4_K",
    "attn_k": "Q5_K",
    "attn_v": "Q6_K",
    "attn_output": "Q5_1",
    "ffn_gate": "Q5_0",
    "ffn_up": "Q4_0",
    "ffn_down": "Q4_1",
}


def _random_k_blocks(rng, rows: int, width: int, type_name: str):
    """Random K-type blocks whose half-precision scales are small (weights of a sane size)."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[type_name]
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * width // elems, nbytes), dtype=np.uint8)
    half = lambda value: np.array([value], dtype=np.float16).view(np.uint8)  # noqa: E731
    if type_name in ("Q4_K", "Q5_K"):
        blocks[:, 0:2] = half(3e-4)  # d
        blocks[:, 2:4] = half(2e-4)  # dmin
    else:  # Q6_K: d is the last two bytes
        blocks[:, -2:] = half(1e-3)
    return blocks.reshape(rows, -1)


def make_tiny_gguf(hf_dir: Path, gguf_path: Path, types: dict[str, str] | None = None, seed: int = 0) -> Path:
    """Quantizes the linear and embedding weights of the tiny checkpoint in ``hf_dir`` into a GGUF
    file's blocks (``types``, default ``TINY_GGUF_TYPES``), writes the file, and writes the blocks'
    float32 dequantization back into ``hf_dir``: as ``tandem.models`` does with a real GGUF, the
    checkpoint is then the file's exact dequantization. Only what ``tandem.quant`` reads is in the
    file (the architecture and the quantized tensors)."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    types = types or TINY_GGUF_TYPES
    rng = np.random.default_rng(seed)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    arch_name = {"gemma3_text": "gemma3", "llama": "llama"}[model.config.model_type]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    name_map = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(gguf_path), arch_name)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) or name == "lm_head":
                continue
            gguf_name = name_map.get_name(name)
            type_name = types[gguf_name.split(".")[-1]]
            qtype = gguf.GGMLQuantizationType[type_name]
            weight = module.weight.detach().float().numpy()
            rows, width = weight.shape
            if type_name.endswith("_K"):
                blocks = _random_k_blocks(rng, rows, width, type_name)
            else:
                blocks = gguf.quants.quantize(weight, qtype)
            writer.add_tensor(gguf_name + ".weight", blocks, raw_shape=blocks.shape, raw_dtype=qtype)
            dense = gguf.quants.dequantize(blocks, qtype).reshape(rows, width)
            module.weight.copy_(torch.from_numpy(np.ascontiguousarray(dense)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(hf_dir)
    return gguf_path


def quantize_linears(model, type_name: str = "Q8_0"):
    """Swaps every nn.Linear of ``model`` for a ``tandem.quant`` QuantLinear of its weight quantized
    to ``type_name`` by gguf-py (no GGUF file: for models built in a test); returns the model."""
    import gguf
    import torch

    from tandem.quant.gguf_blocks import to_quantized
    from tandem.quant.modules import QuantLinear
    from tandem.quant.native import load_kernel

    kernel = load_kernel()
    qtype = gguf.GGMLQuantizationType[type_name]
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear):
            raw = gguf.quants.quantize(module.weight.detach().float().numpy(), qtype)
            swapped = QuantLinear(to_quantized(raw, type_name, tuple(module.weight.shape)), module.bias, kernel)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, swapped)
    return model
