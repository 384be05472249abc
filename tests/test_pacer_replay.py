"""benchmarks/pacer_replay.py: recorded rounds re-timed by the pacer, reported pooled and per stream."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from gateway.pacer import PacerConfig

_spec = importlib.util.spec_from_file_location(
    "pacer_replay", Path(__file__).resolve().parents[1] / "benchmarks" / "pacer_replay.py"
)
pacer_replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pacer_replay)


def alternating(period: float, rounds: int) -> list[tuple[float, int]]:
    """A prefill token, then rounds of 3 and 1 tokens every ``period`` seconds."""
    return [(0.0, 1)] + [(period * (i + 1), 3 if i % 2 == 0 else 1) for i in range(rounds)]


def test_replay_keeps_every_token_within_its_bound_and_flushes_at_the_end():
    rounds = alternating(0.1, 40)
    releases, delays = pacer_replay.replay(rounds, PacerConfig(max_delay_rounds=1.0))
    assert len(releases) == sum(n for _, n in rounds) == len(delays)
    assert releases == sorted(releases)
    assert all(0.0 <= d <= 0.1 + 1e-9 for d in delays)
    assert releases[-1] == pytest.approx(rounds[-1][0])  # nothing outlives the stream
    gaps = pacer_replay._gaps(releases)
    assert gaps[len(gaps) // 2: -2] == pytest.approx([0.05] * len(gaps[len(gaps) // 2: -2]), abs=1e-3)


def test_the_report_separates_pooled_from_per_stream_unevenness(tmp_path, capsys):
    """Two perfectly even streams at different speeds: pooled p90/p50 is their speed ratio, the
    per-stream ratio is 1."""
    fast = [(0.02 * i, 1) for i in range(100)]
    slow = [(0.04 * i, 1) for i in range(30)]
    traces = tmp_path / "rounds.jsonl"
    traces.write_text("".join(json.dumps({"domain": d, "rounds": r}) + "\n" for d, r in
                              (("json", fast), ("prose", slow))))
    assert pacer_replay.main(["replay", str(traces), "--max-delay-rounds", "1"]) == 0
    out = capsys.readouterr().out
    raw = next(line for line in out.splitlines() if line.startswith("raw"))
    assert "p90/p50  2.00" in raw and "within a stream  1.00" in raw
    paced = next(line for line in out.splitlines() if line.startswith("paced, bound 1 rounds"))
    assert "within a stream  1.00" in paced
