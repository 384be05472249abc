"""tandem bench end to end: it starts its own ``tandem serve`` (tiny models, free ports), measures
both modes, stops the stack, then runs the assisted-generation peer. Slow: three real processes."""

from __future__ import annotations

import argparse
import json

import pytest

from tandem.tools import bench

pytestmark = pytest.mark.slow


def test_bench_starts_a_stack_and_runs_the_peer(tiny_dir, tiny_draft_dir, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"domain": "code", "prompt": "def fibonacci(n):"}) + "\n"
                       + json.dumps({"domain": "prose", "prompt": "The quick brown fox"}) + "\n")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args([
        "--start-stack", "--target-model", str(tiny_dir), "--draft-model", str(tiny_draft_dir),
        "--num-speculative-tokens", "3", "--device", "cpu", "--prompts", str(prompts), "--max-tokens", "8",
        "--concurrency", "2", "--peer-assistant", str(tiny_draft_dir), "--json", str(out),
        "--plot", str(tmp_path / "bench.png"), "--no-progress",
    ])
    assert bench.main(args) == 0
    data = json.loads(out.read_text())
    assert data["config"]["stack"] == "started" and data["config"]["draft_model"] == str(tiny_draft_dir)
    assert data["overall"]["speculative"]["requests"] == 2 and data["overall"]["speculative"]["failed"] == 0
    assert data["outputs_identical"] is True  # greedy speculation is lossless
    assert data["peer"]["assistant"] == f"assistant model {tiny_draft_dir}"
    assert data["peer"]["num_assistant_tokens"] == 3
    assert data["peer"]["overall"]["requests"] == 2 and data["speedup_vs_peer"] > 0
    assert data["peer"]["outputs_identical_to_autoregressive"] is True
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "starting tandem serve" in capsys.readouterr().err
