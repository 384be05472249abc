"""tandem bench's --modes and --temperature: validation, request bodies, mode auto's served modes.

The "gateway" here is the fake OpenAI-compatible server of test_bench_peers, which records every
request body and answers usage chunks with a scripted ``speculative_decoding`` object.
"""

from __future__ import annotations

import json

import pytest
from test_bench_gateway import bench_args, prompts_file  # noqa: F401  (fixture)
from test_bench_peers import FakePeer

from tandem.tools import bench
from tandem.tools.bench.client import RequestOptions, parse_modes, parse_temperature, request_body
from tandem.tools.bench.prompts import Prompt


def test_parse_modes() -> None:
    assert parse_modes("on,off") == ("speculative", "autoregressive")
    assert parse_modes(" auto , OFF,on") == ("auto", "autoregressive", "speculative")
    assert parse_modes("speculative") == ("speculative",)
    for bad, message in [("", "at least one"), ("on,fast", "unknown mode 'fast'"), ("on,speculative", "twice")]:
        with pytest.raises(ValueError, match=message):
            parse_modes(bad)


def test_parse_temperature() -> None:
    assert parse_temperature("default") is parse_temperature("None") is parse_temperature(None) is None
    assert parse_temperature("0.7") == 0.7 and parse_temperature(0.0) == 0.0 and parse_temperature(1) == 1.0
    for bad in ("hot", "-0.5", -1.0, "nan"):
        with pytest.raises(ValueError, match="--temperature"):
            parse_temperature(bad)


def test_request_bodies_per_mode() -> None:
    prompt = Prompt("code", "x")
    options = RequestOptions("m", 8, temperature=None, num_speculative_tokens=3)
    bodies = {mode: request_body(prompt, mode, options) for mode in ("speculative", "autoregressive", "auto")}
    assert {m: b["speculation"] for m, b in bodies.items()} == {
        "speculative": "on", "autoregressive": "off", "auto": "auto"}
    assert all("temperature" not in b for b in bodies.values())
    assert "num_speculative_tokens" not in bodies["autoregressive"] and bodies["auto"]["num_speculative_tokens"] == 3
    assert request_body(prompt, "speculative", RequestOptions("m", 8, temperature=0.5))["temperature"] == 0.5
    truncated = RequestOptions("m", 8, temperature=0.8, sampling=(("top_k", 40), ("min_p", 0.05)))
    assert {k: request_body(prompt, "auto", truncated)[k] for k in ("top_k", "min_p")} == {"top_k": 40, "min_p": 0.05}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--modes", "on,turbo"), "tandem bench: --modes: unknown mode 'turbo'"),
        (("--modes", ","), "tandem bench: --modes needs at least one"),
        (("--modes", "off,off"), "tandem bench: --modes: a mode is given twice"),
        (("--temperature", "warm"), "tandem bench: --temperature takes a number"),
        (("--temperature", "-1"), "tandem bench: --temperature must be >= 0"),
        (("--min-p", "1.5"), "tandem bench: --min-p is out of range"),
        (("--top-p", "0"), "tandem bench: --top-p is out of range"),
        (("--top-k", "-1"), "tandem bench: --top-k is out of range"),
    ],
)
def test_bad_modes_and_temperatures_are_refused(argv, message) -> None:
    with pytest.raises(SystemExit, match=message):
        bench.main(bench_args("--url", "http://127.0.0.1:9", *argv))


def scripted_usage(body: dict) -> dict:
    """Mode auto: prompts of domain code are served speculatively, the others fall back once."""
    if body.get("speculation") != "auto":
        return {}
    code = body["prompt"].startswith(("def", "{"))
    return {"speculative_decoding": {"rounds": 2, "draft_tokens": 8, "accepted_tokens": 4, "acceptance_rate": 0.5,
                                     "mode": "speculative" if code else "mixed", "fallbacks": 0 if code else 1}}


def test_modes_auto_and_default_temperature_request_bodies(prompts_file, tmp_path, capsys) -> None:  # noqa: F811
    json_path = tmp_path / "bench.json"
    with FakePeer(models=["served"], usage_extra=scripted_usage) as gateway:
        args = bench_args("--url", gateway.url, "--prompts", str(prompts_file), "--max-tokens", "5", "--modes",
                          "auto,off", "--temperature", "default", "--num-speculative-tokens", "4", "--warmup", "0",
                          "--min-p", "0.05", "--json", str(json_path), "--no-progress")
        assert bench.main(args) == 0
    assert len(gateway.bodies) == 8
    assert all("temperature" not in b and b["model"] == "served" for b in gateway.bodies)
    assert all(b["min_p"] == 0.05 and "top_k" not in b and "top_p" not in b for b in gateway.bodies)
    # Two modes alternate per prompt: auto first on prompts 0 and 2, off first on 1 and 3.
    assert [b["speculation"] for b in gateway.bodies] == ["auto", "off", "off", "auto"] * 2
    assert all(b["num_speculative_tokens"] == 4 for b in gateway.bodies if b["speculation"] == "auto")
    assert not any("num_speculative_tokens" in b for b in gateway.bodies if b["speculation"] == "off")
    data = json.loads(json_path.read_text())
    assert data["modes"] == ["auto", "autoregressive"] and list(data["overall"]) == ["auto", "autoregressive"]
    assert data["speedup"] is None and data["speedup_by_domain"] == {}
    assert data["speedup_auto"] > 0
    assert set(data["speedup_auto_by_domain"]) == {"code", "prose"}
    assert data["auto_served_modes"] == {"mixed": 2, "speculative": 2} and data["auto_fallbacks"] == 2
    assert data["overall"]["auto"]["acceptance_rate"] == pytest.approx(0.5)
    assert data["config"]["temperature"] == "default" and data["config"]["modes"] == ["auto", "autoregressive"]
    assert data["config"]["sampling"] == {"min_p": 0.05}
    assert data["peer"] is None and "greedy only" in data["config"]["peer_skipped"]
    out = capsys.readouterr().out
    assert "auto: requests by served mode: mixed 2, speculative 2; fallbacks: 2" in out
    assert "speedup (auto / autoregressive tokens/s)" in out
    assert "speedup (speculative / autoregressive" not in out


def test_modes_on_only(prompts_file, tmp_path) -> None:  # noqa: F811
    json_path = tmp_path / "bench.json"
    with FakePeer() as gateway:
        args = bench_args("--url", gateway.url, "--prompts", str(prompts_file), "--num-prompts", "2", "--modes", "on",
                          "--temperature", "0.3", "--peer", "none", "--warmup", "1", "--json", str(json_path),
                          "--no-progress")
        assert bench.main(args) == 0
    assert [b["speculation"] for b in gateway.bodies] == ["on"] * 3  # one warm-up, two prompts
    assert {b["temperature"] for b in gateway.bodies} == {0.3}
    data = json.loads(json_path.read_text())
    assert list(data["overall"]) == ["speculative"] and data["speedup"] is None and data["speedup_auto"] is None
    assert data["auto_served_modes"] == {}
