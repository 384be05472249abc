"""tandem serve's supervisor: a child that exits is restarted after a doubling delay, the others
keep running, and each restarted child is told how often it was restarted (its metric)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from tandem.config import ServeSettings
from tandem.supervisor import Backoff, Child, Supervisor
from tandem.telemetry.metrics import RESTARTS_ENV, make_metrics


def test_backoff_doubles_up_to_its_cap_and_starts_over_after_a_stable_run() -> None:
    backoff = Backoff(initial_s=1.0, max_s=8.0, stable_s=60.0)
    assert [backoff.delay(uptime_s=2.0) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert backoff.delay(uptime_s=61.0) == 1.0  # it had stayed up: not a crash loop
    assert backoff.delay(uptime_s=0.5) == 2.0


def _crashing_child(tmp_path: Path) -> Child:
    """Writes the restart count it was given, then exits with 3."""
    record = tmp_path / "starts.txt"
    script = f"import os; open({str(record)!r}, 'a').write(os.environ[{RESTARTS_ENV!r}] + '\\n'); raise SystemExit(3)"
    return Child("crashing", [sys.executable, "-c", script], "", backoff=Backoff(initial_s=0.05, max_s=0.4))


def test_a_child_that_exits_is_restarted_with_backoff_while_the_others_keep_running(tmp_path: Path) -> None:
    crashing = _crashing_child(tmp_path)
    steady = Child("steady", [sys.executable, "-c", "import time; time.sleep(60)"], "")
    supervisor = Supervisor(ServeSettings(), children=[steady, crashing])
    supervisor.start()
    steady_process = steady.process
    watcher = threading.Thread(target=supervisor.watch, kwargs={"poll_s": 0.01})
    watcher.start()
    try:
        record = tmp_path / "starts.txt"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not record.exists() or len(record.read_text().split()) < 4):
            time.sleep(0.05)
    finally:
        supervisor.request_stop()
        watcher.join(timeout=10)
        supervisor.stop(grace_s=5)
    starts = record.read_text().split()
    assert starts[:4] == ["0", "1", "2", "3"]  # each start told how many restarts came before it
    assert crashing.restarts >= 3
    assert steady.process is steady_process and steady.restarts == 0  # untouched by the other's crashes
    assert not watcher.is_alive()


def test_the_restart_delay_grows_between_crashes(tmp_path: Path) -> None:
    crashing = _crashing_child(tmp_path)
    supervisor = Supervisor(ServeSettings(), children=[crashing])
    supervisor.start()
    crashing.process.wait()
    now = time.monotonic()
    supervisor.restart_exited(now)
    first = crashing.restart_at - now
    supervisor.restart_exited(now + first)  # due: started again
    assert crashing.restarts == 1 and crashing.restart_at is None
    crashing.process.wait()
    later = time.monotonic()
    supervisor.restart_exited(later)
    assert crashing.restart_at - later == 2 * first
    supervisor.stop(grace_s=5)


def test_a_service_reports_how_often_it_was_restarted(monkeypatch) -> None:
    def restarts(metrics) -> float:
        return metrics.registry.get_sample_value("tandem_process_restarts")

    monkeypatch.delenv(RESTARTS_ENV, raising=False)
    assert restarts(make_metrics("target")) == 0
    monkeypatch.setenv(RESTARTS_ENV, "3")
    assert restarts(make_metrics("target")) == 3
    monkeypatch.setenv(RESTARTS_ENV, "garbage")
    assert restarts(make_metrics("target")) == 0
