"""`tandem distill` end to end on tiny random-weight targets (CPU, seconds), plus the shipped head (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.cli import main as cli_main

TINY = ["--device", "cpu", "--seq-len", "32", "--gen-new-tokens", "8", "--gen-batch", "2", "--collect-batch", "2",
        "--inner-size", "32", "--reduced-vocab", "64", "--batch", "4", "--max-minutes", "5"]


def distill(target: Path, output: Path, *extra: str) -> int:
    return cli_main(["distill", "--target-model", str(target), "--output", str(output), *TINY, *extra])


def checkpoint_step(output: Path) -> int:
    return json.loads((output / "checkpoint.json").read_text())["state"]["step"]


def assert_head_runs(output: Path, target_dir: Path) -> None:
    from tandem.models.eagle import EagleDrafter, load_head, load_target_tensors

    head, vocab_ids = load_head(output)
    tensors = load_target_tensors(target_dir, head.config, vocab_ids)
    drafter = EagleDrafter(head, vocab_ids, tensors)
    feature = torch.randn(3, head.config.hidden_size)
    new_feature, logits = drafter.step(feature, torch.tensor([1, 2, 3]))
    assert new_feature.shape == (3, head.config.hidden_size)
    assert logits.shape == (3, head.config.reduced_vocab_size)
    assert torch.isfinite(logits).all()


def test_eagle_distill_writes_a_loadable_head(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    from tandem.models import load_tokenizer, tokenizer_fingerprint

    out = tmp_path / "head"
    assert distill(tiny_gemma_dir, out, "--max-tokens", "400", "--max-steps", "3") == 0
    assert_head_runs(out, tiny_gemma_dir)
    config = json.loads((out / "eagle.json").read_text())
    assert config["target_fingerprint"] == tokenizer_fingerprint(load_tokenizer(str(tiny_gemma_dir)))
    meta = config["metadata"]
    assert meta["train_steps"] == 3 and meta["tokens"] >= 400
    assert len(meta["heldout"]["rollout"]) == 5
    assert 0.0 <= meta["heldout"]["one_step"] <= 1.0
    assert 0.0 < meta["reduced_vocab"]["heldout_coverage"] <= 1.0


def test_resume_continues_from_the_checkpoint(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert distill(tiny_dir, out, "--max-tokens", "300", "--max-steps", "2") == 0
    manifest = json.loads((out / "features" / "manifest.json").read_text())
    assert checkpoint_step(out) == 2
    assert distill(tiny_dir, out, "--resume", "--max-steps", "5") == 0
    assert checkpoint_step(out) == 5  # advanced from 2, not restarted
    # the features were reused, not collected again
    assert json.loads((out / "features" / "manifest.json").read_text()) == manifest
    assert json.loads((out / "eagle.json").read_text())["metadata"]["train_steps"] == 5
    assert_head_runs(out, tiny_dir)


def test_interrupted_collection_and_training_resume(tiny_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from tandem.tools.distill import collect, train_loop

    out = tmp_path / "run"
    real_run_job = collect.run_job
    calls = {"n": 0}

    def dying_run_job(runner, job):
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt
        return real_run_job(runner, job)

    monkeypatch.setattr(collect, "run_job", dying_run_job)
    with pytest.raises(KeyboardInterrupt):
        distill(tiny_dir, out, "--max-tokens", "400", "--max-steps", "4")
    assert json.loads((out / "features" / "manifest.json").read_text())["jobs_done"] == 5
    monkeypatch.setattr(collect, "run_job", real_run_job)

    real_run = train_loop.run

    def dying_run(run_dir, model, optimizer, state, step_fn, config, deadline, max_steps, desc):
        config.checkpoint_seconds = 0.0  # checkpoint after every step

        def step_then_die(step):
            if step >= 2:
                raise KeyboardInterrupt
            return step_fn(step)

        return real_run(run_dir, model, optimizer, state, step_then_die, config, deadline, max_steps, desc)

    monkeypatch.setattr(train_loop, "run", dying_run)
    with pytest.raises(KeyboardInterrupt):
        distill(tiny_dir, out, "--resume", "--max-tokens", "400", "--max-steps", "4")
    assert checkpoint_step(out) == 2
    assert not (out / "eagle.json").exists()
    monkeypatch.setattr(train_loop, "run", real_run)
    assert distill(tiny_dir, out, "--resume", "--max-steps", "4") == 0
    assert checkpoint_step(out) == 4
    assert_head_runs(out, tiny_dir)


def test_standalone_distill_matches_the_target_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tandem.models import load_tokenizer, tokenizer_fingerprint

    out = tmp_path / "draft"
    assert distill(tiny_dir, out, "--kind", "standalone", "--width", "32", "--max-tokens", "300",
                   "--max-steps", "3") == 0
    target_tok = load_tokenizer(str(tiny_dir))
    assert tokenizer_fingerprint(load_tokenizer(str(out))) == tokenizer_fingerprint(target_tok)
    vocab_ids = load_file(str(out / "tandem_vocab_ids.safetensors"))["vocab_ids"]
    assert vocab_ids.dtype == torch.int64
    assert int(vocab_ids[0]) == (target_tok.unk_token_id if target_tok.unk_token_id is not None
                                 else target_tok.pad_token_id)
    assert len(set(vocab_ids.tolist())) == vocab_ids.numel()
    assert int(vocab_ids.max()) < len(target_tok)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.vocab_size == vocab_ids.numel()
    logits = model(input_ids=torch.tensor([[0, 1, 2]])).logits
    assert logits.shape == (1, 3, vocab_ids.numel())
    summary = json.loads((out / "distill.json").read_text())
    assert summary["kind"] == "standalone" and len(summary["heldout"]["rollout"]) == 5


def test_unknown_kind_is_a_clear_error(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["distill", "--kind", "nope", "--output", str(tmp_path / "x")])
    assert exc.value.code != 0
    assert "--kind" in capsys.readouterr().err


def test_init_from_fine_tunes_a_head_and_keeps_its_shape_and_vocabulary(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tandem.models.eagle import load_head

    first = tmp_path / "first"
    assert distill(tiny_gemma_dir, first, "--max-tokens", "300", "--max-steps", "2") == 0
    before, vocab_before = load_head(first)
    # zero steps: exactly the given head comes back out (it is not re-initialised from the data)
    same = tmp_path / "same"
    assert distill(tiny_gemma_dir, same, "--init-from", str(first), "--seed", "1", "--max-tokens", "300",
                   "--max-steps", "0") == 0
    copied, _ = load_head(same)
    for name, tensor in before.state_dict().items():
        assert torch.equal(copied.state_dict()[name], tensor), name
    # asking for another width and vocabulary size: the given head's are kept
    tuned = tmp_path / "tuned"
    assert distill(tiny_gemma_dir, tuned, "--init-from", str(first), "--seed", "1", "--inner-size", "48",
                   "--reduced-vocab", "40", "--max-tokens", "300", "--max-steps", "3") == 0
    after, vocab_after = load_head(tuned)
    assert after.config.inner_size == before.config.inner_size == 32
    assert torch.equal(vocab_after, vocab_before)
    assert torch.equal(load_file(str(tuned / "vocab.safetensors"))["vocab_ids"], vocab_before)
    assert any(not torch.equal(t, before.state_dict()[name]) for name, t in after.state_dict().items())
    meta = json.loads((tuned / "eagle.json").read_text())["metadata"]
    assert meta["init_from"]["path"] == str(first)
    assert meta["init_from"]["metadata"]["train_steps"] == 2
    assert meta["train_steps"] == 3


def test_init_from_rejects_heads_of_other_targets_and_standalone(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    first = tmp_path / "first"
    assert distill(tiny_gemma_dir, first, "--max-tokens", "200", "--max-steps", "1") == 0
    config = json.loads((first / "eagle.json").read_text())
    (first / "eagle.json").write_text(json.dumps({**config, "target_fingerprint": "someone-else"}))
    with pytest.raises(SystemExit, match="another target .*tokenizer fingerprint someone-else"):
        distill(tiny_gemma_dir, tmp_path / "b", "--init-from", str(first))
    with pytest.raises(SystemExit, match="not an eagle head directory"):
        distill(tiny_gemma_dir, tmp_path / "c", "--init-from", str(tmp_path / "nothing-here"))
    with pytest.raises(SystemExit, match="does not apply to --kind standalone"):
        distill(tiny_gemma_dir, tmp_path / "d", "--kind", "standalone", "--init-from", str(first))


def test_missing_target_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["distill", "--target-model", str(tmp_path / "no-such-model"), "--output", str(tmp_path / "x")])
    assert "cannot load target" in str(exc.value.code)


def test_bad_numbers_and_empty_resume_are_clear_errors(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--max-minutes must be positive"):
        distill(tiny_dir, tmp_path / "a", "--max-minutes", "0")
    with pytest.raises(SystemExit, match="nothing to resume"):
        distill(tiny_dir, tmp_path / "b", "--resume")
    with pytest.raises(SystemExit, match="--prose-share must be within"):
        distill(tiny_dir, tmp_path / "c", "--code-prefix-share", "0.6", "--prose-share", "0.5")
    with pytest.raises(SystemExit, match="--sampled-share must be within"):
        distill(tiny_dir, tmp_path / "d", "--sampled-share", "1.5")
    with pytest.raises(SystemExit, match="--sampled-tokens must be within"):
        distill(tiny_dir, tmp_path / "e", "--sampled-share", "0.5", "--sampled-tokens", "16")  # half of --seq-len 32


def test_sampled_openings_are_seeded_draws_then_the_greedy_continuation(tiny_gemma_dir: Path) -> None:
    from tandem.tools.distill.collect import CollectConfig, TargetRunner
    from tandem.models import load_model

    loaded = load_model(str(tiny_gemma_dir), device="cpu", dtype="float32")
    runner = TargetRunner(loaded, CollectConfig(seq_len=32, gen_new_tokens=12))
    sequences, prompt_lens = runner.generate([""] * 4, sampled=5, seed=7)
    assert prompt_lens == [6] * 4  # BOS and the five sampled tokens count as the prompt
    assert (sequences, prompt_lens) == runner.generate([""] * 4, sampled=5, seed=7)
    assert len({tuple(s[:6]) for s in sequences}) > 1  # the openings differ between rows
    assert sequences != runner.generate([""] * 4, sampled=5, seed=8)[0]
    with torch.inference_mode():
        for seq in sequences:  # after the opening, every token is the target's argmax
            logits = loaded.model(input_ids=torch.tensor([seq])).logits[0]  # [len, vocab]
            assert seq[6:] == logits[5:-1].argmax(-1).tolist()[: len(seq) - 6]


def test_sampled_openings_replace_a_share_of_training_generation_jobs_only(tiny_gemma_dir: Path) -> None:
    import itertools

    from tandem.tools.distill.collect import CollectConfig, TargetRunner, job_stream
    from tandem.models import load_model

    loaded = load_model(str(tiny_gemma_dir), device="cpu", dtype="float32")

    def generation_jobs(share: float) -> list:
        config = CollectConfig(seq_len=32, gen_every=1, sampled_share=share, sampled_tokens=4)
        return list(itertools.islice(job_stream(TargetRunner(loaded, config), config, seed=0), 40))

    jobs = generation_jobs(0.5)
    heldout = [j for j in jobs if j.heldout and j.prompts is not None]
    train = [j for j in jobs if not j.heldout]
    assert heldout and all(j.sampled == 0 and all(j.prompts) for j in heldout)
    opened = [j for j in train if j.sampled]
    assert 8 < len(opened) < 30 and all(j.sampled == 4 and set(j.prompts) == {""} for j in opened)
    assert len({j.seed for j in opened}) == len(opened)
    assert not any(j.sampled for j in generation_jobs(0.0))


@pytest.mark.slow
def test_shipped_head_matches_the_default_target() -> None:
    from tandem.models.eagle import EagleDrafter, builtin_head_dir, load_head, load_target_tensors
    from tandem.models import load_tokenizer, resolve, tokenizer_fingerprint

    folder = builtin_head_dir("gemma-3-270m")
    assert folder is not None, "no shipped head in tandem/data/eagle/gemma-3-270m"
    head, vocab_ids = load_head(folder)
    config = head.config
    assert config.hidden_size == 640 and config.target_vocab_size == 262144
    assert config.target_fingerprint == tokenizer_fingerprint(load_tokenizer("gemma-3-270m"))
    assert vocab_ids.shape == (config.reduced_vocab_size,) and int(vocab_ids.max()) < 262144
    tensors = load_target_tensors(resolve("gemma-3-270m").hf_dir, config, vocab_ids)
    feature, logits = EagleDrafter(head, vocab_ids, tensors).step(torch.randn(2, 640), torch.tensor([2, 100]))
    assert feature.shape == (2, 640) and logits.shape == (2, config.reduced_vocab_size)
    assert config.metadata["heldout"]["rollout"]
    # its measured acceptance, which a fresh draft service's block-length policy starts from
    from draft_service.block_length import load_prior
    from tandem.models.eagle import ACCEPTANCE_FILE

    prior = load_prior(folder / ACCEPTANCE_FILE)
    sources = {source.split(":")[0] for source, _ in prior}
    assert {"lookup", "head"} <= sources
    assert prior[("lookup:16", 0)] > prior[("lookup:1", 0)]  # a longer agreeing context copies better
    assert prior[("head:0.9", 0)] > prior[("head:0.2", 0)]  # and a surer head drafts better


def test_teacher_labels_are_the_float32_targets_choices(tiny_gemma_dir: Path) -> None:
    from tandem.tools.distill.collect import CollectConfig, TargetRunner
    from tandem.models import load_model

    loaded = load_model(str(tiny_gemma_dir), device="cpu", dtype="float32")
    runner = TargetRunner(loaded, CollectConfig(seq_len=24, topk=4, gen_new_tokens=6, gen_dtype="bfloat16"))
    sequences, prompt_lens = runner.generate(["def f(x):", "The quick brown"])
    assert all(len(s) > p for s, p in zip(sequences, prompt_lens, strict=True))
    shard = runner.teacher(sequences)
    seq = torch.tensor([sequences[0]])
    with torch.inference_mode():
        logits = loaded.model(input_ids=seq).logits[0].float()  # [len, vocab]
    n = len(sequences[0])
    assert torch.equal(shard["topk_ids"][0, :n].long(), logits.topk(4, dim=-1).indices)
    expected = torch.log_softmax(logits, -1).topk(4, dim=-1).values
    assert torch.allclose(shard["topk_logprobs"][0, :n].float(), expected, atol=0.05)
    assert torch.allclose(shard["features"][0, :n].float(), loaded.model.get_decoder()(input_ids=seq)
                          .last_hidden_state[0].detach(), atol=1e-2)
