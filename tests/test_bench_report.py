"""tandem bench: report maths on synthetic samples, the JSON schema and the PNG plot (no network)."""

from __future__ import annotations

import json
import struct

import pytest

from tandem.tools.bench.client import RequestResult
from tandem.tools.bench.metrics import percentile, summarize, tpot
from tandem.tools.bench.report import build_report, format_report, summarize_peer, write_json


def result(domain: str, mode: str, tokens: int, ttft: float, e2e: float, gaps: list[float], index: int = 0,
           rounds: int = 0, drafted: int = 0, accepted: int = 0, text: str = "x", error: str | None = None):
    return RequestResult(domain, mode, tokens, ttft, e2e, gaps, rounds, drafted, accepted, text, prompt_index=index,
                         error=error)


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 0.5) == 3.0
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 5.0
    assert percentile(values, 0.9) == pytest.approx(4.6)
    assert percentile(list(range(101)), 0.99) == pytest.approx(99.0)
    assert percentile([], 0.5) == 0.0
    assert percentile([7.0], 0.99) == 7.0


def test_tpot_ttft_tokens_per_s_and_acceptance() -> None:
    a = result("code", "speculative", 11, 0.5, 1.5, [0.1] * 10, rounds=4, drafted=16, accepted=7)
    b = result("code", "speculative", 5, 0.2, 1.0, [0.2, 0.2, 0.2, 0.2], rounds=2, drafted=8, accepted=3)
    one = result("code", "speculative", 1, 0.3, 0.3, [])
    assert tpot(a) == pytest.approx(0.1) and tpot(b) == pytest.approx(0.2) and tpot(one) is None
    s = summarize([a, b, one])
    assert s.requests == 3 and s.completion_tokens == 17
    assert s.tokens_per_s == pytest.approx(17 / 2.8)
    assert s.tpot_s == pytest.approx(0.15)
    assert s.ttft_p50_s == pytest.approx(0.3)
    assert s.itl_p50_s == pytest.approx(0.1) and s.itl_p99_s == pytest.approx(0.2)
    assert s.acceptance_rate == pytest.approx(10 / 24)
    assert s.mean_accepted_length == pytest.approx((10 + 6) / 6)


def test_jitter_is_each_streams_own_p90_over_p50_not_the_pooled_one() -> None:
    """Two even streams at different speeds pool to a ratio of 2 but neither stutters; a stream
    with a pause of one round after every three quick tokens does."""
    fast = result("json", "speculative", 11, 0.1, 0.3, [0.02] * 10)
    slow = result("prose", "speculative", 11, 0.1, 0.5, [0.04] * 10)
    even = summarize([fast, slow, result("prose", "speculative", 11, 0.1, 0.5, [0.02] * 10)])
    assert even.itl_p90_s / even.itl_p50_s == pytest.approx(2.0)
    assert even.itl_p90_over_p50_per_stream == pytest.approx(1.0)
    bursty = summarize([result("code", "speculative", 13, 0.1, 0.5, [0.01, 0.01, 0.01, 0.04] * 3)])
    assert bursty.itl_p90_over_p50_per_stream == pytest.approx(4.0)
    assert summarize([result("code", "speculative", 2, 0.1, 0.2, [0.1])]).itl_p90_over_p50_per_stream is None


def test_failed_requests_are_counted_not_measured() -> None:
    ok = result("code", "autoregressive", 4, 0.1, 0.4, [0.1] * 3)
    bad = result("code", "autoregressive", 0, 0.0, 0.0, [], error="HTTP 500")
    s = summarize([ok, bad])
    assert (s.requests, s.failed, s.completion_tokens) == (1, 1, 4)
    assert s.acceptance_rate is None and s.mean_accepted_length is None


def synthetic_run() -> list[RequestResult]:
    """Two domains; speculative is 2x faster on code and 1x on prose."""
    return [
        result("code", "speculative", 10, 0.1, 1.0, [0.1] * 9, 0, rounds=3, drafted=12, accepted=7, text="a"),
        result("code", "autoregressive", 10, 0.1, 2.0, [0.2] * 9, 0, text="a"),
        result("prose", "autoregressive", 10, 0.1, 1.0, [0.1] * 9, 1, text="b"),
        result("prose", "speculative", 10, 0.1, 1.0, [0.1] * 9, 1, rounds=5, drafted=20, accepted=5, text="b"),
    ]


def test_speedup_overall_and_per_domain() -> None:
    report = build_report("http://x", "m", 10, synthetic_run())
    assert report.speedup == pytest.approx((20 / 2.0) / (20 / 3.0))
    assert report.speedup_by_domain == {"code": pytest.approx(2.0), "prose": pytest.approx(1.0)}
    assert report.outputs_identical is True
    assert report.by_domain["code"]["speculative"].acceptance_rate == pytest.approx(7 / 12)
    assert report.peer is None and report.speedup_vs_peer is None
    text = format_report(report)
    assert "speedup (speculative / autoregressive tokens/s): 1.50x" in text and "code 2.00x" in text


def test_outputs_that_differ_across_modes_are_flagged() -> None:
    run = synthetic_run()
    run[1].text = "different"
    assert build_report("http://x", "m", 10, run).outputs_identical is False
    sampled = build_report("http://x", "m", 10, run, greedy=False)  # sampled texts may differ: not compared
    assert sampled.outputs_identical is None and "outputs identical" not in format_report(sampled)


def peer_results() -> list[RequestResult]:
    return [
        result("code", "peer", 10, 0.2, 4.0, [0.4] * 9, 0, rounds=5, accepted=5, text="a"),
        result("prose", "peer", 10, 0.2, 2.0, [0.2] * 9, 1, rounds=10, accepted=0, text="c"),
    ]


def test_peer_speedup_and_json_schema(tmp_path) -> None:
    run = synthetic_run()
    peer = summarize_peer(peer_results(), run, "prompt lookup", "tiny", 4)
    assert peer.overall.mean_accepted_length == pytest.approx(20 / 15)
    assert peer.overall.acceptance_rate is None  # transformers does not say how many it drafted
    assert peer.outputs_identical_to_autoregressive is False  # prose differs
    report = build_report("http://x", "m", 10, run, peer, duration_s=3.0, config={"concurrency": 2})
    assert report.speedup_vs_peer == pytest.approx((20 / 2.0) / (20 / 6.0))
    assert report.speedup_vs_peer_by_domain == {"code": pytest.approx(4.0), "prose": pytest.approx(2.0)}
    path = tmp_path / "bench.json"
    write_json(report, path)
    data = json.loads(path.read_text())
    assert {"url", "model", "max_tokens", "speedup", "overall", "by_domain", "outputs_identical",
            "speedup_by_domain", "peer", "speedup_vs_peer", "speedup_vs_peer_by_domain", "config", "modes",
            "speedup_auto", "speedup_auto_by_domain", "auto_served_modes", "auto_fallbacks", "peers"} <= data.keys()
    assert data["modes"] == ["speculative", "autoregressive"] and data["peers"] == []
    assert data["speedup_auto"] is None and data["auto_served_modes"] == {}
    assert set(data["overall"]) == {"speculative", "autoregressive"}
    for field in ("tokens_per_s", "ttft_p50_s", "itl_p50_s", "itl_p90_s", "itl_p99_s", "tpot_s",
                  "acceptance_rate", "mean_accepted_length", "itl_p90_over_p50_per_stream"):
        assert field in data["overall"]["speculative"]
    assert data["by_domain"]["code"]["speculative"]["tokens_per_s"] == pytest.approx(10.0)
    assert data["peer"]["assistant"] == "prompt lookup" and data["peer"]["by_domain"]["prose"]["requests"] == 1
    assert data["config"] == {"concurrency": 2}
    assert "peer: transformers assisted generation, prompt lookup" in format_report(report)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png(tmp_path) -> None:
    run = synthetic_run()
    peer = summarize_peer(peer_results(), run, "prompt lookup", "tiny", 4)
    report = build_report("http://x", "m", 10, run, peer)
    from tandem.tools.bench.plot import write_plot

    path = tmp_path / "bench.png"
    write_plot(report, [*run, *peer_results()], path)
    width, height = png_size(path)
    assert width >= 800 and height >= 300
    assert path.stat().st_size > 10_000


def test_plot_without_gaps_or_peer(tmp_path) -> None:
    run = [result("code", m, 1, 0.1, 0.1, []) for m in ("speculative", "autoregressive")]
    from tandem.tools.bench.plot import write_plot

    path = tmp_path / "empty.png"
    write_plot(build_report("http://x", "m", 1, run), run, path)
    assert png_size(path)[0] > 0
