"""Quality of the quantized target against its float32 dequantization (and llama.cpp on the same file).

    python benchmarks/quant_quality.py                                  # gemma-3-270m, every kernel here
    python benchmarks/quant_quality.py --llama-perplexity /path/to/llama-perplexity --json out.json

Two measures, for the float32 checkpoint (``--dtype float32``) and for each quantized kernel this
host can run (``TANDEM_QUANT_KERNEL``: the float32-activation builds and the int8-activation VNNI
build):

* greedy agreement: each bench prompt's greedy continuation (``--max-tokens``) against the float32
  one, as the number of leading tokens that are identical (mean over prompts, and how many prompts
  agree all the way);
* perplexity on a held-out text (the Python standard library's ``textwrap`` and ``json`` sources,
  which no bench prompt and no distill corpus uses), scored as ``llama-perplexity`` does: chunks of
  ``--context`` tokens, each beginning with BOS, the second half of each chunk scored. With
  ``--llama-perplexity`` the same text goes through llama.cpp's tool on the same GGUF file.

Each quantized build is measured twice: through transformers' module tree (``generate`` and one
forward per chunk), and through the pass the target serves (``target_service.ragged.forward`` with
``row_exact``: row-by-row attention, the Gemma pass without the module tree, one decode step per
token), whose summation orders differ and which is what users get.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from tandem.tools.bench.prompts import load_prompts
from tandem.models import load_model, resolve
from tandem.quant.native import available_kernels
from target_service import kv_cache, ragged


def held_out_text() -> str:
    import json as json_module
    import textwrap

    return inspect.getsource(textwrap) + inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder)


@torch.inference_mode()
def greedy(model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    ids = torch.tensor([tokenizer(prompt).input_ids])
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


@torch.inference_mode()
def perplexity(model, tokenizer, text: str, context: int, logits_of=None) -> tuple[float, int]:
    """(perplexity, scored tokens) over chunks of ``context`` tokens, the second half of each scored;
    ``logits_of(chunk) -> [context, vocab]``, by default the module tree's forward."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    bos = tokenizer.bos_token_id
    nll, scored = 0.0, 0
    for start in range(0, len(ids) - context + 1, context):
        chunk = [bos, *ids[start : start + context - 1]]
        logits = (logits_of(chunk) if logits_of else model(torch.tensor([chunk])).logits[0]).float()  # [context, vocab]
        logp = torch.log_softmax(logits[:-1], dim=-1)  # predicts chunk[1:]
        first = context // 2
        targets = torch.tensor(chunk[first + 1 :])
        nll -= float(logp[first:].gather(1, targets[:, None]).sum())
        scored += len(targets)
    return math.exp(nll / scored), scored


@torch.inference_mode()
def served_greedy(model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    """The greedy tokens the target serves: the prompt in one row-exact pass, then a step a token."""
    cache = kv_cache.new_cache()
    step, out = tokenizer(prompt).input_ids, []
    for _ in range(max_tokens):
        (logits,), _ = ragged.forward(model, [cache], [step], "cpu", last_only=[True], row_exact=True)  # [1, vocab]
        out.append(int(logits[-1].argmax()))
        step = out[-1:]
    return out


@torch.inference_mode()
def served_perplexity(model, tokenizer, text: str, context: int) -> tuple[float, int]:
    """As :func:`perplexity`, each chunk one row-exact pass as the target prefills a prompt."""
    def logits_of(chunk: list[int]) -> torch.Tensor:
        (logits,), _ = ragged.forward(model, [kv_cache.new_cache()], [chunk], "cpu", row_exact=True)
        return logits  # [context, vocab]

    return perplexity(model, tokenizer, text, context, logits_of)


def llama_perplexity(binary: str, gguf: Path, text: str, context: int, threads: int) -> float | None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    result = subprocess.run([binary, "-m", str(gguf), "-f", f.name, "-c", str(context), "-t", str(threads)],
                            capture_output=True, text=True, check=False)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
    return float(found.group(1)) if found else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--kernels", nargs="*", default=None, help="default: every build this host runs")
    parser.add_argument("--llama-perplexity", default=None, metavar="PATH", help="llama.cpp's llama-perplexity")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    prompts = load_prompts(None, 0)
    text = held_out_text()
    dense = load_model(args.model, device="cpu", dtype="float32")
    reference = [greedy(dense.model, dense.tokenizer, p.prompt, args.max_tokens) for p in prompts]
    rows = {"float32": {"perplexity": perplexity(dense.model, dense.tokenizer, text, args.context)[0]}}
    for isa in args.kernels if args.kernels is not None else available_kernels():
        os.environ["TANDEM_QUANT_KERNEL"] = isa
        quantized = load_model(args.model, device="cpu", dtype="auto")
        ragged.install(quantized.model)
        for way, decode, score in (("", greedy, perplexity), (", served pass", served_greedy, served_perplexity)):
            prefixes = []
            for prompt, want in zip(prompts, reference):
                got = decode(quantized.model, quantized.tokenizer, prompt.prompt, args.max_tokens)
                prefixes.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want)))
            ppl, scored = score(quantized.model, quantized.tokenizer, text, args.context)
            rows[f"quantized ({isa}{way})"] = {
                "perplexity": ppl,
                "mean_identical_prefix": sum(prefixes) / len(prefixes),
                "prompts_identical": sum(p == args.max_tokens for p in prefixes),
                "prompts": len(prefixes),
                "scored_tokens": scored,
            }
        del quantized
    if args.llama_perplexity:
        resolved = resolve(args.model)
        rows["llama.cpp"] = {"perplexity": llama_perplexity(args.llama_perplexity, resolved.gguf, text, args.context,
                                                             args.threads)}
    for name, row in rows.items():
        extra = ""
        if "mean_identical_prefix" in row:
            extra = (f"  greedy vs float32: {row['mean_identical_prefix']:.1f} of {args.max_tokens} leading tokens "
                     f"identical on average, {row['prompts_identical']}/{row['prompts']} prompts identical throughout")
        ppl = row["perplexity"]
        print(f"{name:<38} perplexity {'-' if ppl is None else format(ppl, '.4f')}{extra}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
