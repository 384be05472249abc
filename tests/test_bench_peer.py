"""tandem bench's peer: transformers' assisted generation on tiny models, in-process."""

from __future__ import annotations

import pytest
from tiny import make_tiny_model

from tandem.tools.bench.peer import PeerError, run_peer
from tandem.tools.bench.prompts import Prompt

PROMPTS = [Prompt("code", "def fibonacci(n):\n"), Prompt("prose", "The quick brown fox")]


def plain_greedy(model_dir, prompt: str, max_tokens: int) -> list[int]:
    from tandem.models import load_model

    loaded = load_model(str(model_dir), device="cpu", dtype="float32")
    encoded = loaded.tokenizer(prompt, return_tensors="pt")
    out = loaded.model.generate(**encoded, max_new_tokens=max_tokens, do_sample=False,
                                pad_token_id=loaded.tokenizer.pad_token_id)
    return out[0, encoded["input_ids"].shape[1]:].tolist()


def test_prompt_lookup_peer(tiny_dir) -> None:
    run = run_peer(str(tiny_dir), None, PROMPTS, max_tokens=12, k=4, device="cpu", dtype="float32")
    assert run.assistant.startswith("prompt lookup")
    assert [r.domain for r in run.results] == ["code", "prose"] and all(r.mode == "peer" for r in run.results)
    for r in run.results:
        assert 1 <= r.completion_tokens <= 12
        assert 1 <= r.rounds <= r.completion_tokens  # one streamed chunk per target forward
        assert r.accepted_tokens == r.completion_tokens - r.rounds
        assert len(r.chunk_gaps_s) == r.rounds - 1 and 0 < r.ttft_s <= r.e2e_s


def test_assistant_model_peer_is_lossless(tiny_dir, tiny_draft_dir) -> None:
    done = []
    run = run_peer(str(tiny_dir), str(tiny_draft_dir), PROMPTS, max_tokens=10, k=3, device="cpu", dtype="float32",
                   on_done=done.append)
    assert run.assistant == f"assistant model {tiny_draft_dir}" and len(done) == 2
    from tandem.models import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_dir))
    for prompt, r in zip(PROMPTS, run.results):
        assert r.text == tokenizer.decode(plain_greedy(tiny_dir, prompt.prompt, 10), skip_special_tokens=True)


def test_the_target_as_its_own_assistant_accepts_everything(tiny_dir) -> None:
    run = run_peer(str(tiny_dir), str(tiny_dir), PROMPTS[:1], max_tokens=12, k=3, device="cpu", dtype="float32")
    r = run.results[0]
    if r.completion_tokens == 12:  # no early EOS: rounds of K accepted + 1 bonus
        assert r.rounds == 3


def test_assistant_with_another_tokenizer_is_refused(tiny_dir, tmp_path) -> None:
    other = make_tiny_model(tmp_path / "other", seed=3, tokenizer_vocab_size=280)
    with pytest.raises(PeerError, match="does not share the target's tokenizer"):
        run_peer(str(tiny_dir), str(other), PROMPTS, max_tokens=4, k=2, device="cpu", dtype="float32")


def test_missing_models_are_peer_errors(tiny_dir, tmp_path) -> None:
    with pytest.raises(PeerError, match="cannot load the target"):
        run_peer(str(tmp_path / "nothing"), None, PROMPTS, max_tokens=4, k=2, device="cpu")
    with pytest.raises(PeerError, match="cannot load the assistant"):
        run_peer(str(tiny_dir), str(tmp_path / "nothing"), PROMPTS, max_tokens=4, k=2, device="cpu")
