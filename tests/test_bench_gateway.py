"""tandem bench against the real gateway in front of scripted target and draft doubles (in-process)."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from gateway_fakes import fake_stack, tokenizer  # noqa: F401  (fixtures)

from tandem.tools import bench
from tandem.tools.bench.client import RequestOptions, run_one
from tandem.tools.bench.prompts import Prompt


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [("code", "def fibonacci(n):"), ("prose", "The quick brown fox"), ("code", '{"name": "tandem"'),
            ("prose", "Speculative decoding drafts")]
    path.write_text("".join(json.dumps({"domain": d, "prompt": p}) + "\n" for d, p in rows))
    return path


async def test_one_request_per_mode(tokenizer, tiny_dir) -> None:  # noqa: F811
    import httpx

    async with fake_stack(tokenizer, str(tiny_dir)) as stack:
        options = RequestOptions(tiny_dir.name, 8, num_speculative_tokens=4)

        def both() -> tuple:
            with httpx.Client(timeout=30) as client:
                return tuple(run_one(client, stack.base_url, Prompt("code", "hi"), mode, options)
                             for mode in ("speculative", "autoregressive"))

        spec, ar = await asyncio.to_thread(both)
    assert spec.completion_tokens == ar.completion_tokens == 8
    assert spec.text == ar.text and spec.rounds > 0 and spec.accepted_tokens > 0
    assert ar.rounds == 0 and ar.draft_tokens == 0
    assert spec.ttft_s > 0 and spec.e2e_s >= spec.ttft_s


@pytest.mark.parametrize("load", [("--concurrency", "3"), ("--request-rate", "50", "--seed", "2")])
async def test_bench_main_writes_json_and_plot(tokenizer, tiny_dir, prompts_file, tmp_path, capsys, load) -> None:  # noqa: F811
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    async with fake_stack(tokenizer, str(tiny_dir)) as stack:
        args = bench_args("--url", stack.base_url, "--prompts", str(prompts_file), "--max-tokens", "12",
                          "--peer", "none", "--json", str(json_path), "--plot", str(png_path), "--no-progress",
                          "--stream-smoothing", "off", *load)
        status = await asyncio.to_thread(bench.main, args)
        await stack.wait_until_idle()
    assert status == 0
    data = json.loads(json_path.read_text())
    assert data["url"] == stack.base_url and data["model"] == tiny_dir.name and data["max_tokens"] == 12
    assert data["overall"]["speculative"]["requests"] == data["overall"]["autoregressive"]["requests"] == 4
    assert data["overall"]["speculative"]["completion_tokens"] == 48
    assert data["speedup"] > 0 and set(data["speedup_by_domain"]) == {"code", "prose"}
    assert set(data["by_domain"]) == {"code", "prose"}
    # The draft double accepts K // 2 of K = 4 tokens: 2 of 4 drafted, 3 tokens per verification.
    assert data["overall"]["speculative"]["acceptance_rate"] == pytest.approx(0.5, abs=0.1)
    assert data["overall"]["autoregressive"]["acceptance_rate"] is None
    assert data["outputs_identical"] is True
    assert data["peer"] is None and data["speedup_vs_peer"] is None
    assert data["config"]["stack"] == "external" and data["config"]["peer_skipped"] == "--peer none"
    if "--request-rate" in load:
        assert data["config"]["request_rate"] == 50.0 and data["config"]["concurrency"] is None
    else:
        assert data["config"]["concurrency"] == 3
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "speedup (speculative / autoregressive tokens/s)" in out and "prose" in out


async def test_repeats_send_the_prompt_set_again_in_each_mode(tokenizer, tiny_dir, prompts_file, tmp_path) -> None:  # noqa: F811
    json_path = tmp_path / "bench.json"
    async with fake_stack(tokenizer, str(tiny_dir)) as stack:
        args = bench_args("--url", stack.base_url, "--prompts", str(prompts_file), "--num-prompts", "2",
                          "--repeats", "3", "--max-tokens", "4", "--warmup", "0", "--peer", "none", "--no-progress",
                          "--json", str(json_path))
        assert await asyncio.to_thread(bench.main, args) == 0
    data = json.loads(json_path.read_text())
    assert data["overall"]["speculative"]["requests"] == data["overall"]["autoregressive"]["requests"] == 6
    assert data["by_domain"]["code"]["speculative"]["requests"] == 3  # prompt 0 of each pass
    assert data["config"]["num_prompts"] == 2 and data["config"]["repeats"] == 3
    assert data["outputs_identical"] is True


async def test_peer_auto_is_skipped_for_another_served_model(tokenizer, tiny_dir, prompts_file, capsys) -> None:  # noqa: F811
    async with fake_stack(tokenizer, str(tiny_dir)) as stack:
        args = bench_args("--url", stack.base_url, "--prompts", str(prompts_file), "--num-prompts", "1",
                          "--max-tokens", "4", "--warmup", "0", "--no-progress")
        status = await asyncio.to_thread(bench.main, args)
    assert status == 0
    assert "peer skipped: the gateway serves" in capsys.readouterr().err


def test_unreachable_gateway_is_a_clear_error() -> None:
    from tandem.tools.bench.stack import free_port

    args = bench_args("--url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1", "--no-progress")
    with pytest.raises(SystemExit, match="tandem bench: the gateway at .* failed"):
        bench.main(args)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--concurrency", "0"), "--concurrency must be >= 1"),
        (("--request-rate", "-1"), "--request-rate must be >= 0"),
        (("--max-tokens", "0"), "--max-tokens must be >= 1"),
        (("--repeats", "0"), "--repeats must be >= 1"),
        (("--plot", "out.jpg"), "give a .png path"),
        (("--prompts", "/nonexistent/prompts.jsonl"), "cannot read the prompt file"),
    ],
)
def test_bad_arguments_are_refused(argv, message) -> None:
    with pytest.raises(SystemExit, match=message):
        bench.main(bench_args("--url", "http://127.0.0.1:9", *argv))


def test_a_stack_that_cannot_start_is_a_clear_error(tmp_path) -> None:
    args = bench_args("--start-stack", "--target-model", str(tmp_path / "no-such-model"), "--num-prompts", "1",
                      "--no-progress")
    with pytest.raises(SystemExit, match="tandem serve exited with"):
        bench.main(args)


async def test_bench_sends_its_key_to_a_keyed_gateway_only(tokenizer, tiny_dir, prompts_file, tmp_path) -> None:  # noqa: F811
    from tandem.tools.bench.client import key_hooks

    json_path = tmp_path / "bench.json"
    async with fake_stack(tokenizer, str(tiny_dir), api_keys="sk-bench") as stack:
        refused = bench_args("--url", stack.base_url, "--prompts", str(prompts_file), "--max-tokens", "4",
                             "--peer", "none", "--no-progress", "--limit", "1")
        with pytest.raises(SystemExit, match="401"):
            await asyncio.to_thread(bench.main, refused)
        args = bench_args("--url", stack.base_url, "--prompts", str(prompts_file), "--max-tokens", "4",
                          "--peer", "none", "--no-progress", "--limit", "1", "--api-key", "sk-bench",
                          "--json", str(json_path))
        assert await asyncio.to_thread(bench.main, args) == 0
        await stack.wait_until_idle()
    assert json.loads(json_path.read_text())["overall"]["speculative"]["requests"] == 1
    import httpx

    (hook,) = key_hooks("http://127.0.0.1:8000", "sk-x")["request"]
    mine, other = httpx.Request("GET", "http://127.0.0.1:8000/v1/models"), httpx.Request("GET", "http://127.0.0.1:9/x")
    hook(mine), hook(other)
    assert mine.headers["authorization"] == "Bearer sk-x" and "authorization" not in other.headers
