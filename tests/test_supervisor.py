"""tandem serve's supervisor: a child that exits is restarted after a doubling delay, the others
keep running, and each restarted child is told how often it was restarted (its metric)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tandem.config import ServeSettings
from tandem.supervisor import Backoff, Child, Supervisor, child_commands
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
    assert crashing.restart_at - later == pytest.approx(2 * first)  # float sums of time.monotonic()
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


def test_a_fleet_is_supervised_child_by_child() -> None:
    supervisor = Supervisor(ServeSettings(targets=3, drafts=2))
    assert [c.name for c in supervisor.children] == ["target-0", "target-1", "target-2", "draft-0", "draft-1", "gateway"]
    assert [c.role for c in supervisor.children] == ["target"] * 3 + ["draft"] * 2 + ["gateway"]
    assert len({id(c.backoff) for c in supervisor.children}) == 6  # each its own backoff
    assert [m.port for m in supervisor.fleet.targets] == [50053, 50055, 50057]  # what the ready block prints
    assert [c.name for c in child_commands(ServeSettings())] == ["target", "draft", "gateway"]


def _stopping_child(name: str, record: Path) -> Child:
    """Marks itself up, then on SIGTERM writes its name to ``record`` and exits."""
    script = (
        "import signal, sys, time\n"
        f"def bye(*_):\n    open({str(record)!r}, 'a').write({name!r} + '\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        f"open({str(record)!r} + '.up', 'a').write('x')\n"
        "while True: time.sleep(0.01)\n"
    )
    return Child(name, [sys.executable, "-c", script], "")


def test_stop_takes_the_gateway_then_the_drafts_then_the_targets(tmp_path: Path) -> None:
    record = tmp_path / "stopped.txt"
    names = ["target-0", "target-1", "draft-0", "draft-1", "gateway"]
    supervisor = Supervisor(ServeSettings(), children=[_stopping_child(n, record) for n in names])
    supervisor.start()
    up = Path(str(record) + ".up")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not up.exists() or len(up.read_text()) < len(names)):
        time.sleep(0.02)
    supervisor.stop(grace_s=10)
    stopped = record.read_text().split()
    assert stopped[0] == "gateway"
    assert sorted(stopped[1:3]) == ["draft-0", "draft-1"] and sorted(stopped[3:]) == ["target-0", "target-1"]
    assert all(c.exited() == 0 for c in supervisor.children)


def test_each_child_of_a_fleet_logs_under_its_own_name():
    from tandem.config import ServeSettings
    from tandem.supervisor import child_commands

    children = child_commands(ServeSettings(targets=2, drafts=1, target_port=0, draft_port=0, grpc_port=0,
                                            http_port=0))
    assert [c.env["TANDEM_LOG_NAME"] for c in children] == ["target-0", "target-1", "draft-0", "gateway"]


def test_a_first_start_builds_the_kernels_beside_the_conversion(monkeypatch, tmp_path: Path) -> None:
    """The kernels' build (a process of its own) runs while the GGUF converts, and is done before
    any child starts; a warm start, a CUDA target or float32 weights start no build."""
    from tandem import models
    from tandem.models import specs

    events: list[str] = []

    class FakeBuild:
        def __init__(self, argv, **_kwargs) -> None:
            assert "prebuild()" in argv[-1]
            events.append("build started")

        def wait(self) -> int:
            events.append("build waited for")
            return 0

    def fake_resolve(spec: str) -> specs.ResolvedSpec:
        events.append(f"resolved {spec}")
        return specs.ResolvedSpec(spec, spec, tmp_path)

    monkeypatch.setattr(subprocess, "Popen", FakeBuild)
    monkeypatch.setattr(models, "resolve", fake_resolve)
    monkeypatch.setattr(models, "needs_conversion", lambda spec: spec == "gemma-3-270m")
    Supervisor(ServeSettings(draft_model="ngram"), children=[]).prepare_models()
    assert events == ["build started", "resolved gemma-3-270m", "build waited for"]
    for settings in (ServeSettings(draft_model="ngram", device="cuda:0"),
                     ServeSettings(draft_model="ngram", dtype="float32"),
                     ServeSettings(draft_model="ngram", target_model=str(tmp_path))):
        events.clear()
        Supervisor(settings, children=[]).prepare_models()
        assert events == [f"resolved {settings.target_model}"]


def test_needs_conversion_says_whether_a_spec_converts_without_converting(monkeypatch, tmp_path: Path) -> None:
    from tandem.models import specs

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(specs, "_convert_gguf", lambda *_args: pytest.fail("nothing converts"))
    gguf = tmp_path / "my.gguf"
    gguf.write_bytes(b"GGUF")
    assert specs.needs_conversion("gemma-3-270m") and specs.needs_conversion(str(gguf))
    (specs._gguf_out(gguf) / ".complete").parent.mkdir(parents=True)
    (specs._gguf_out(gguf) / ".complete").write_text("{}")
    (tmp_path / "cache" / "models" / "gemma-3-270m").mkdir(parents=True)
    (tmp_path / "cache" / "models" / "gemma-3-270m" / ".complete").write_text("{}")
    assert not specs.needs_conversion("gemma-3-270m") and not specs.needs_conversion(str(gguf))
    assert not specs.needs_conversion(str(tmp_path))  # a checkpoint folder converts nothing




@pytest.mark.parametrize("held", ["http_port", "target_metrics_port", "draft_port"])
def test_a_port_another_process_holds_stops_serve_at_once_with_its_flag(held: str, monkeypatch, capsys) -> None:
    """Refused before any model is prepared or child started, in one line naming the port and its flag."""
    import socket

    from tandem import supervisor
    from tandem.tools.bench.stack import free_ports

    names = ("http_port", "grpc_port", "target_port", "draft_port", "target_metrics_port", "draft_metrics_port")
    ports = dict(zip(names, free_ports(len(names))))
    monkeypatch.setattr(Supervisor, "prepare_models", lambda self: pytest.fail("nothing should be prepared"))
    monkeypatch.setattr(Supervisor, "start", lambda self: pytest.fail("no child should start"))
    with socket.socket() as other:  # another program's server
        other.bind(("127.0.0.1", ports[held]))
        other.listen()
        assert supervisor.serve(ServeSettings(**ports)) == 2
    flag = "--" + held.replace("_", "-")
    error = capsys.readouterr().err
    assert f"port {ports[held]} (" in error and f"{flag}) is in use by another process" in error, error
    # Freed, the same ports pass the check (a closed server's connections do not count).
    monkeypatch.setattr(Supervisor, "prepare_models", lambda self: self.request_stop())
    monkeypatch.setattr(Supervisor, "start", lambda self: None)
    assert supervisor.serve(ServeSettings(**ports)) == 0


@pytest.mark.parametrize("flag, spec, message", [
    ("target_model", "google/gemma-3-270m",
     "--target-model: model spec 'google/gemma-3-270m' is not a folder or file here"),
    ("draft_model", "eagel", "--draft-model: model spec 'eagel' is neither"),
])
def test_a_model_spec_that_names_nothing_stops_serve_in_one_line(flag, spec, message, monkeypatch, capsys) -> None:
    from tandem import supervisor
    from tandem.tools.bench.stack import free_ports

    names = ("http_port", "grpc_port", "target_port", "draft_port", "target_metrics_port", "draft_metrics_port")
    ports = dict(zip(names, free_ports(len(names))))
    monkeypatch.setattr(Supervisor, "start", lambda self: pytest.fail("no child should start"))
    assert supervisor.serve(ServeSettings(**ports, **{flag: spec})) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error, error
