"""deploy/: the Prometheus configuration and alert rules (checked and unit-tested by promtool) and
the Grafana provisioning and dashboard (which may only use metrics the services export)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tandem.telemetry.metrics import make_metrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool comes with the Debian package `prometheus` (.ci/run installs it)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=PROMETHEUS)


def test_promtool_checks_the_alert_rules() -> None:
    result = promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 4 rules found" in result.stdout


def test_promtool_checks_the_prometheus_config() -> None:
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_fire_when_they_should() -> None:
    """alerts_test.yml: low acceptance fires after 5 minutes (not before, not at 90%, not idle),
    error and fallback rates, TTFT p99."""
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_cover_what_the_issue_asks() -> None:
    rules = {r["alert"]: r for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    low = rules["TandemLowAcceptanceRate"]
    assert "< 0.75" in low["expr"] and low["for"] == "5m"
    assert "tandem_session_fallbacks_total" in rules["TandemHighFallbackRate"]["expr"]
    assert 'status="error"' in rules["TandemHighErrorRate"]["expr"]
    assert "histogram_quantile(0.99" in rules["TandemSlowTimeToFirstToken"]["expr"]


def test_prometheus_scrapes_all_three_services_on_their_metrics_ports() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    targets = {g["labels"]["service"]: g["targets"] for job in config["scrape_configs"] for g in job["static_configs"]}
    assert targets == {"gateway": ["gateway:8000"], "draft": ["draft:9052"], "target": ["target:9053"]}


# -- Grafana -----------------------------------------------------------------------------------


def exported_series() -> set[str]:
    """Every sample name the services can export (counters as *_total, histograms in parts)."""
    names = set()
    for family in make_metrics("any").registry.collect():
        if family.type == "counter":
            names |= {f"{family.name}_total", f"{family.name}_created"}
        elif family.type == "histogram":
            names |= {f"{family.name}_{part}" for part in ("bucket", "count", "sum", "created")}
        else:
            names.add(family.name)
    return names


def test_dashboard_uses_only_exported_metrics_and_labels() -> None:
    dashboard = json.loads((GRAFANA / "dashboards" / "tandem.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs
    series = exported_series()
    used = {name for e in exprs for name in re.findall(r"\b(tandem_[a-z0-9_]+)\b", e)}
    assert used and used <= series, used - series
    # Every DESIGN §3 metric has a panel, except the raw gauge the panels derive from counters.
    families = {n.removesuffix("_total").removesuffix("_bucket").removesuffix("_count") for n in used}
    design = {f.name for f in make_metrics("any").registry.collect()}
    assert design - families == {"tandem_spec_decode_acceptance_rate"}
    labels = {label for e in exprs for group in re.findall(r"by \(([^)]*)\)", e) for label in group.split(",")}
    allowed = {"le", "position", "reason", "mode", "status", "temperature", "load", "phase", "role", "address", "outcome"}
    assert {label.strip() for label in labels} <= allowed
    services = set(re.findall(r'service="([a-z]+)"', " ".join(exprs)))
    assert services <= {"gateway", "draft", "target"}
    titles = {p["title"] for p in dashboard["panels"]}
    for wanted in ("Acceptance rate", "Acceptance by position", "Mean accepted length", "Tokens/s",
                   "Time to first token", "Inter-token latency", "Fallbacks by reason", "Sessions by mode"):
        assert wanted in titles
    assert all(p["datasource"]["uid"] == "prometheus" for p in dashboard["panels"])


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus() -> None:
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "datasources.yml").read_text())
    by_uid = {d["uid"]: d for d in datasources["datasources"]}
    assert by_uid["prometheus"]["url"] == "http://prometheus:9090" and by_uid["prometheus"]["isDefault"]
    assert by_uid["jaeger"]["type"] == "jaeger"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "dashboards.yml").read_text())["providers"]
    compose = yaml.safe_load((DEPLOY.parent / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    mounted_at = {m.split(":")[1]: m.split(":")[0] for m in mounts}
    dashboards_dir = providers[0]["options"]["path"]
    assert mounted_at[dashboards_dir] == "./deploy/grafana/dashboards"
    assert mounted_at["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"


@pytest.mark.parametrize("path", sorted(p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*.yml")))
def test_every_deploy_yaml_parses(path: str) -> None:
    assert yaml.safe_load((DEPLOY / path).read_text())
