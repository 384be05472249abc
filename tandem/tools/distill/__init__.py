"""``tandem distill``: train a draft for a target on the target's own outputs.

One run is a folder (``--output``) that holds everything needed to resume: the feature cache
(``features/``, reusable by the other kind through ``--features-dir``), the chosen reduced vocabulary,
the newest training checkpoint and ``distill.json`` (what was asked, what was measured). A run
spends about ``--collect-fraction`` of ``--max-minutes`` running the target (held-out set first), then
trains until the budget minus a reserve for the held-out measurement, then writes the draft:
``eagle.json`` + ``head.safetensors`` for ``--kind eagle`` (loadable by ``tandem.models.eagle.load_head``), a
Hugging Face directory for ``--kind standalone``. Running the same command again resumes.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple

KINDS = ("eagle", "standalone")
RUN_FILE = "distill.json"
VOCAB_FILE = "vocab.safetensors"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=KINDS, default="eagle",
                        help="eagle: feature-conditioned head on the target's states; standalone: small causal LM")
    parser.add_argument("--target-model", default="gemma-3-270m", help="target SPEC (HF dir, .gguf or built-in name)")
    parser.add_argument("--output", required=True, help="run folder; also where the trained draft is written")
    parser.add_argument("--features-dir", default=None, help="feature cache (default OUTPUT/features); may be shared")
    parser.add_argument("--max-minutes", type=float, default=30.0, help="wall-clock budget of this invocation")
    parser.add_argument("--max-tokens", type=int, default=None, help="stop collecting after this many training tokens")
    parser.add_argument("--max-steps", type=int, default=None, help="stop training after this many steps (total)")
    parser.add_argument("--collect-fraction", type=float, default=0.55,
                        help="share of the budget spent running the target (when collection is not done)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--reduced-vocab", type=int, default=16384, help="target tokens the draft can propose")
    parser.add_argument("--resume", action="store_true", help="require an existing run in --output and continue it")
    parser.add_argument("--restart", action="store_true", help="discard the training checkpoint (keeps the features)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-from", default=None, metavar="HEAD",
                        help="eagle: fine-tune this head (a head directory, or 'builtin' for the target's shipped "
                             "one) instead of a fresh one; its width, depth and reduced vocabulary are kept")
    group = parser.add_argument_group("collection")
    group.add_argument("--seq-len", type=int, default=256)
    group.add_argument("--topk", type=int, default=8, help="target choices kept per position for the soft loss")
    group.add_argument("--collect-batch", type=int, default=8)
    group.add_argument("--gen-batch", type=int, default=32, help="prompts per batched greedy generation")
    group.add_argument("--gen-new-tokens", type=int, default=96)
    group.add_argument("--gen-every", type=int, default=6, help="one generation job every N jobs")
    group.add_argument("--code-prefix-share", type=float, default=0.5,
                       help="share of generation prompts that are stdlib function openings (the rest templated)")
    group.add_argument("--prose-share", type=float, default=0.0,
                       help="share of generation prompts that are prose openings: stories, letters, explanations, "
                            "instructions, reviews (the rest templated)")
    group.add_argument("--sampled-share", type=float, default=0.0,
                       help="share of generation jobs whose openings the target samples itself from BOS "
                            "(temperature 1, --sampled-tokens long) before continuing greedily")
    group.add_argument("--sampled-tokens", type=int, default=24, help="tokens of each sampled opening")
    group.add_argument("--gen-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                       help="dtype of the generating copy (labels always come from the float32 target)")
    group.add_argument("--collect-only", action="store_true",
                       help="only fill the feature cache (until --max-minutes or --max-tokens), train nothing")
    group = parser.add_argument_group("training")
    group.add_argument("--lr", type=float, default=None, help="default 1e-3 (eagle), 2e-3 (standalone)")
    group.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    group.add_argument("--unroll", type=int, default=5, help="eagle: steps fed with the head's own features")
    group.add_argument("--inner-size", type=int, default=1024, help="eagle: MLP width")
    group.add_argument("--num-layers", type=int, default=2, help="eagle: MLP hidden layers")
    group.add_argument("--layers", type=int, default=2, help="standalone: transformer layers")
    group.add_argument("--width", type=int, default=256, help="standalone: hidden size")
    group.add_argument("--checkpoint-minutes", type=float, default=2.0)
    group.add_argument("--ce-fraction", type=float, default=0.5,
                       help="eagle: share of positions per unrolled step scored over the reduced vocabulary")
    group.add_argument("--feature-loss-weight", type=float, default=0.1, help="eagle: feature regression weight")
    group.add_argument("--no-bf16", action="store_true", help="train in float32 (default: bfloat16 autocast)")


def _fail(message: str) -> SystemExit:
    return SystemExit(f"tandem distill: {message}")


def _validate(args: argparse.Namespace) -> None:
    if args.kind not in KINDS:
        raise _fail(f"unknown --kind {args.kind!r}; use one of {', '.join(KINDS)}")
    positive = {"--max-minutes": args.max_minutes, "--seq-len": args.seq_len, "--topk": args.topk,
                "--batch": args.batch, "--unroll": args.unroll, "--gen-every": args.gen_every}
    for flag, value in positive.items():
        if value is None or value <= 0:
            raise _fail(f"{flag} must be positive, got {value}")
    if args.reduced_vocab < 2:
        raise _fail(f"--reduced-vocab must be at least 2, got {args.reduced_vocab}")
    if not 0.0 <= args.code_prefix_share <= 1.0:
        raise _fail(f"--code-prefix-share must be within [0, 1], got {args.code_prefix_share}")
    if not 0.0 <= args.prose_share <= 1.0 - args.code_prefix_share:
        raise _fail(f"--prose-share must be within [0, 1 - --code-prefix-share], got {args.prose_share}")
    if not 0.0 <= args.sampled_share <= 1.0:
        raise _fail(f"--sampled-share must be within [0, 1], got {args.sampled_share}")
    if args.sampled_share > 0 and not 0 < args.sampled_tokens < args.seq_len // 2:
        raise _fail(f"--sampled-tokens must be within [1, --seq-len / 2), got {args.sampled_tokens}")
    if not 0.0 <= args.collect_fraction <= 1.0:
        raise _fail(f"--collect-fraction must be within [0, 1], got {args.collect_fraction}")
    if args.seq_len <= args.unroll + 1:
        raise _fail("--seq-len must exceed --unroll + 1")
    if args.resume and args.restart:
        raise _fail("--resume and --restart contradict each other")
    if args.init_from is not None and args.kind != "eagle":
        raise _fail("--init-from fine-tunes an eagle head; it does not apply to --kind standalone")


def _text_config(hf_dir: Path) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_dir))
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def main(args: argparse.Namespace) -> int:
    _validate(args)
    import torch

    from tandem.tools.distill import collect as collect_mod
    from tandem.tools.distill import train_loop
    from tandem.tools.distill.store import FeatureStore, Manifest
    from tandem.models import ModelSpecError, load_model, load_tokenizer, pick_device, resolve, tokenizer_fingerprint

    started = time.monotonic()
    deadline = started + args.max_minutes * 60
    try:
        resolved = resolve(args.target_model)
        tokenizer = load_tokenizer(args.target_model)
    except (ModelSpecError, OSError, ValueError) as exc:
        raise _fail(f"cannot load target {args.target_model!r}: {exc}") from exc
    device = pick_device(args.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise _fail("--device cuda asked for, but no CUDA device is available")
    torch.manual_seed(args.seed)
    output = Path(args.output)
    features_dir = Path(args.features_dir) if args.features_dir else output / "features"
    run_file = output / RUN_FILE
    if run_file.exists():
        previous = json.loads(run_file.read_text())
        if previous.get("kind") != args.kind:
            raise _fail(f"{output} holds a {previous.get('kind')} run; use another --output for --kind {args.kind}")
    elif args.resume and not (features_dir / "manifest.json").exists():
        raise _fail(f"--resume: nothing to resume in {output}")
    output.mkdir(parents=True, exist_ok=True)
    if args.restart:
        train_loop.clear_checkpoint(output)

    text_config = _text_config(resolved.hf_dir)
    vocab_size, hidden = int(text_config.vocab_size), int(text_config.hidden_size)
    fingerprint = tokenizer_fingerprint(tokenizer)
    initial = _initial_head(args.init_from, args.target_model, fingerprint, hidden, vocab_size)
    collect_config = collect_mod.CollectConfig(
        seq_len=args.seq_len, topk=args.topk, batch=args.collect_batch, gen_batch=args.gen_batch,
        gen_new_tokens=args.gen_new_tokens, gen_every=args.gen_every, gen_dtype=args.gen_dtype,
        code_prefix_share=args.code_prefix_share, prose_share=args.prose_share, sampled_share=args.sampled_share,
        sampled_tokens=args.sampled_tokens)
    store = FeatureStore.open(features_dir, Manifest(
        target_model=args.target_model, target_fingerprint=fingerprint, hidden_size=hidden, vocab_size=vocab_size,
        seq_len=args.seq_len, topk=args.topk, seed=args.seed))

    # 1. the target's features (skipped once training has started: the data is then frozen)
    collect_deadline = deadline if args.collect_only else started + args.collect_fraction * (deadline - started)
    heldout_done = len(store.manifest.heldout_shards) >= collect_config.heldout_gen_batches + collect_config.heldout_batches
    wanted = args.collect_only or args.collect_fraction > 0 or not heldout_done or not store.manifest.train_shards
    if wanted and not train_loop.has_checkpoint(output):
        loaded = load_model(args.target_model, device=device, dtype="float32")
        runner = collect_mod.TargetRunner(loaded, collect_config)
        collect_mod.collect(runner, store, collect_deadline, args.max_tokens)
        del runner, loaded
    if args.collect_only:
        print(json.dumps(_collection_summary(store, started), indent=2))
        return 0

    # 2. the reduced vocabulary, chosen once per run from the target's choices
    train = store.load(heldout=False)
    heldout = store.load(heldout=True)
    fixed_vocab = initial.vocab_ids if initial is not None else None
    vocab_ids, vocab_info = _vocab(output, train, heldout, tokenizer, vocab_size, args.reduced_vocab, fixed_vocab)

    reserve = min(max(0.08 * (deadline - started), 10.0), 150.0)  # the held-out measurement + export
    common = {"args": args, "output": output, "store": store, "train": train, "heldout": heldout, "vocab_ids": vocab_ids,
                  "vocab_info": vocab_info, "device": device, "train_deadline": deadline - reserve, "started": started}
    if args.kind == "eagle":
        summary = _run_eagle(resolved.hf_dir, text_config, fingerprint, initial=initial, **common)
    else:
        summary = _run_standalone(tokenizer, text_config, **common)
    run_file.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["heldout"], indent=2))
    return 0


class InitialHead(NamedTuple):
    """--init-from: the head to fine-tune, its reduced vocabulary, where it came from, its record."""

    head: Any  # tandem.models.eagle.EagleHead
    vocab_ids: Any  # [reduced] int64
    directory: Path
    metadata: dict


def _initial_head(spec: str | None, target_model: str, fingerprint: str, hidden: int,
                  vocab_size: int) -> InitialHead | None:
    """The head --init-from names, checked against the target."""
    if spec is None:
        return None
    from tandem.models.eagle import EagleCheckpointError, builtin_head_dir, load_head, target_mismatches

    directory = builtin_head_dir(target_model) if spec == "builtin" else Path(spec)
    if directory is None:
        raise _fail(f"--init-from builtin: tandem ships no eagle head for {target_model!r}")
    try:
        head, vocab_ids = load_head(directory)
    except (EagleCheckpointError, OSError) as exc:
        raise _fail(f"--init-from {spec}: {exc}") from exc
    problems = target_mismatches(head.config, fingerprint, hidden, vocab_size)
    if problems:
        raise _fail(f"--init-from {spec}: the head was trained for another target than {target_model!r}: "
                    f"{'; '.join(problems)}")
    return InitialHead(head, vocab_ids, directory, dict(head.config.metadata or {}))


def _vocab(output: Path, train: dict, heldout: dict, tokenizer: Any, vocab_size: int, size: int,
           fixed: Any = None):
    """The run's reduced vocabulary: chosen once from the target's choices, or ``fixed`` (a fine-tuned head's)."""
    import torch
    from safetensors.torch import load_file

    from tandem.tools.distill.store import atomic_save_tensors
    from tandem.tools.distill.vocab import choose_vocab, coverage, coverage_curve

    train_choices = train["topk_ids"][..., 0][train["valid"].bool()]
    heldout_choices = heldout["topk_ids"][..., 0][heldout["valid"].bool()]
    path = output / VOCAB_FILE
    if fixed is not None:
        vocab_ids = fixed
        atomic_save_tensors(path, {"vocab_ids": vocab_ids})
    elif path.exists():
        vocab_ids = load_file(str(path))["vocab_ids"]
    else:
        first = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else (tokenizer.pad_token_id or 0)
        specials = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
        vocab_ids = choose_vocab(train_choices, vocab_size, size, first, specials)
        atomic_save_tensors(path, {"vocab_ids": vocab_ids})
    info = {
        "size": int(vocab_ids.numel()),
        "heldout_coverage": round(coverage(vocab_ids, heldout_choices, vocab_size), 5),
        "heldout_coverage_by_size": coverage_curve(train_choices, heldout_choices, vocab_size),
        "distinct_train_choices": int(torch.unique(train_choices).numel()),
    }
    return vocab_ids, info


def _loop_config(args: argparse.Namespace, default_lr: float):
    from tandem.tools.distill.train_loop import LoopConfig

    return LoopConfig(lr=args.lr or default_lr, checkpoint_seconds=args.checkpoint_minutes * 60)


def _progress(deadline: float, max_steps: int | None, output: Path):
    """Training progress in [0, 1] of this invocation: by time, or by steps when --max-steps is given."""
    from tandem.tools.distill import train_loop

    started = time.monotonic()
    first = json.loads((output / train_loop.POINTER).read_text())["state"]["step"] if train_loop.has_checkpoint(
        output) else 0
    counter = {"calls": 0}

    def progress() -> float:
        counter["calls"] += 1
        by_time = (time.monotonic() - started) / max(deadline - started, 1e-6)
        if max_steps is None:
            return min(by_time, 1.0)
        return min(max(by_time, (counter["calls"] - 1) / max(max_steps - first, 1)), 1.0)

    return progress


def _train_or_resume(args, output: Path, model, loop_config, step_fn, deadline: float, desc: str):
    from tandem.tools.distill import train_loop

    optimizer = train_loop.make_optimizer(model, loop_config)
    state = train_loop.LoopState()
    if train_loop.has_checkpoint(output):
        state = train_loop.load_checkpoint(output, model, optimizer)
    return train_loop.run(output, model, optimizer, state, step_fn, loop_config, deadline, args.max_steps, desc)


def _collection_summary(store, started: float) -> dict:
    m = store.manifest
    return {"train_tokens": dict(m.tokens), "heldout_tokens": dict(m.heldout_tokens), "jobs": m.jobs_done,
            "collect_minutes": round(m.seconds / 60, 2), "seq_len": m.seq_len, "topk": m.topk, "seed": m.seed,
            "sources": "python stdlib sources, pydoc topics, synthetic JSON, target greedy generations "
                       "from templated code/json/math/chat/prose prompts, stdlib function openings and "
                       "(--prose-share, --sampled-share) prose openings and openings the target sampled"}


def _run_eagle(hf_dir: Path, text_config: Any, fingerprint: str, *, initial, args, output, store, train, heldout,
               vocab_ids, vocab_info, device, train_deadline, started) -> dict:
    import torch

    from tandem.tools.distill import eagle_train
    from tandem.tools.distill.evaluate import summarize
    from tandem.tools.distill.vocab import reduced_index
    from tandem.models.eagle import EagleConfig, EagleHead, load_target_tensors, save_head

    embed_name, head_name = _target_tensor_names(hf_dir, text_config)
    config = EagleConfig(
        hidden_size=int(text_config.hidden_size), inner_size=args.inner_size, num_layers=args.num_layers,
        reduced_vocab_size=int(vocab_ids.numel()), target_vocab_size=int(text_config.vocab_size),
        target_model=args.target_model, target_fingerprint=fingerprint, embed_tensor=embed_name,
        head_tensor=head_name, logit_softcap=getattr(text_config, "final_logit_softcapping", None))
    if initial is not None:  # fine-tuning: the given head's shape, vocabulary and weights
        head = initial.head
        config = head.config = replace(head.config, target_model=args.target_model, metadata={})
    else:
        head = EagleHead(config)
    head = head.to(device)
    target = load_target_tensors(hf_dir, config, vocab_ids)
    target.embed, target.head_rows = target.embed.to(device), target.head_rows.to(device)
    table = reduced_index(vocab_ids, config.target_vocab_size)
    train_config = eagle_train.EagleTrainConfig(
        unroll=args.unroll, batch=args.batch, ce_fraction=args.ce_fraction,
        feature_loss_weight=args.feature_loss_weight, bf16=not args.no_bf16)
    data = eagle_train.prepare(train, table, device)
    if initial is None:
        eagle_train.init_from_data(head, data)
    step_fn = eagle_train.make_step_fn(head, target, data, train_config, args.seed,
                                       _progress(train_deadline, args.max_steps, output))
    state = _train_or_resume(args, output, head, _loop_config(args, 1e-3), step_fn, train_deadline, "train eagle head")
    del data
    hits = eagle_train.rollout_hits(head, target, vocab_ids, heldout, steps=max(args.unroll, 5), device=device)
    agreement = summarize(hits, heldout).as_dict()
    metadata = {
        "kind": "eagle", "trained_on": _collection_summary(store, started),
        "tokens": store.train_tokens, "train_steps": state.step, "train_windows": state.samples,
        "train_minutes": round(state.seconds / 60, 2),
        "minutes": round((store.manifest.seconds + state.seconds) / 60, 2),
        "unroll": args.unroll, "train_config": asdict(train_config), "lr": args.lr or 1e-3,
        "reduced_vocab": vocab_info, "heldout": agreement,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if initial is not None:  # what it was fine-tuned from, and that head's own record
        metadata["init_from"] = {"path": str(initial.directory), "metadata": initial.metadata}
    head.config.metadata = metadata
    save_head(output, head.cpu().float(), vocab_ids, dtype=torch.float16)
    return {"kind": "eagle", "target_model": args.target_model, **metadata}


def _target_tensor_names(hf_dir: Path, text_config: Any) -> tuple[str, str]:
    """The embedding and LM-head tensor names in the target's safetensors (tied heads share the embedding)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    embed = next((n for n in names if n.endswith("embed_tokens.weight")), None)
    if embed is None:
        raise _fail(f"the target in {hf_dir} has no embed_tokens tensor")
    head = next((n for n in names if n.endswith("lm_head.weight")), None)
    if head is None or getattr(text_config, "tie_word_embeddings", False):
        head = embed
    return embed, head


def _run_standalone(tokenizer: Any, text_config: Any, *, args, output, store, train, heldout, vocab_ids, vocab_info,
                    device, train_deadline, started) -> dict:
    from tandem.tools.distill import standalone
    from tandem.tools.distill.evaluate import summarize
    from tandem.tools.distill.vocab import reduced_index

    table = reduced_index(vocab_ids, int(text_config.vocab_size))
    config = standalone.StandaloneConfig(layers=args.layers, width=args.width, batch=args.batch)

    def reduced(token_id: int | None) -> int | None:
        return None if token_id is None or table[token_id] < 0 else int(table[token_id])

    specials = {"bos": reduced(tokenizer.bos_token_id), "eos": reduced(tokenizer.eos_token_id),
                "pad": reduced(tokenizer.pad_token_id)}
    model = standalone.build_model(config, int(vocab_ids.numel()), max(args.seq_len, 2048), specials).to(device)
    step_fn = standalone.make_step_fn(model, train, table, config, args.seed, device)
    state = _train_or_resume(args, output, model, _loop_config(args, 2e-3), step_fn, train_deadline,
                             "train standalone draft")
    hits = standalone.rollout_hits(model, vocab_ids, table, heldout, steps=5, device=device)
    agreement = summarize(hits, heldout).as_dict()
    model.cpu()
    standalone.save(output, model, tokenizer, vocab_ids)
    return {
        "kind": "standalone", "target_model": args.target_model, "trained_on": _collection_summary(store, started),
        "tokens": store.train_tokens, "train_steps": state.step, "train_windows": state.samples,
        "train_minutes": round(state.seconds / 60, 2), "model": asdict(config), "reduced_vocab": vocab_info,
        "heldout": agreement, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
