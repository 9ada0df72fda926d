"""Metrics and dashboards: docs/metrics.md against the code, the generated Prometheus
configuration, the Grafana dashboard, the control plane's metrics on a real database, and
`modelplane up --prometheus` scraping a running platform and evaluating a recording rule."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from cluster.protocol import Replica
from controlplane.prometheus import (RECORDING_RULES, TARGET_FILES, config_document, find_prometheus_binary,
                                     write_config)
from controlplane.prometheus_targets import target_groups, write_if_changed
from controlplane.settings import Settings
from controlplane.state_metrics import Snapshot, StateCollector, families, read_snapshot
from serving.router.metrics import Metrics
from serving.runtime.pyfunc.metrics import ServerMetrics
from tests.conftest import wait_for

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "metrics.md"
DASHBOARD = REPO / "deploy" / "grafana" / "modelplane.json"
TARGET_LABELS = {"endpoint", "revision", "replica", "runtime"}


# -- docs/metrics.md -------------------------------------------------------------------------

def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def _rows(section: str) -> list[list[str]]:
    rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")]
            for line in section.splitlines() if line.startswith("| `")]
    return rows


def documented_metrics() -> dict[str, tuple[str, set[str], set[str]]]:
    """name → (type, the labels the exposing process sets, the target labels marked †)."""
    found = {}
    for name, kind, labels, *_ in _rows(_section("Every metric")):
        marked = re.findall(r"`([^`]+)`(†?)", labels)
        found[name.strip("`")] = (kind, {label for label, dagger in marked if not dagger},
                                  {label for label, dagger in marked if dagger})
    return found


def documented_rules() -> list[tuple[str, str]]:
    return [(record.strip("`"), expr.strip("`")) for record, expr, _ in _rows(_section("Recording rules"))]


def registered_metrics() -> dict[str, tuple[str, set[str]]]:
    """Every metric the router, the pyfunc server and the control-plane exporter register, by the
    name PromQL sees (counters with ``_total``) → (type, label names)."""
    def exposed(name: str, kind: str) -> str:
        return f"{name}_total" if kind == "counter" else name

    found = {}
    for owner in (Metrics(), ServerMetrics(CollectorRegistry())):
        for wrapper in vars(owner).values():
            if isinstance(wrapper, MetricWrapperBase):
                found[exposed(wrapper._name, wrapper._type)] = (wrapper._type, set(wrapper._labelnames))
    for family in families(Snapshot()):
        found[exposed(family.name, family.type)] = (family.type, set(family._labelnames))
    return found


@pytest.mark.parametrize("name", sorted(registered_metrics()))
def test_every_metric_the_code_registers_is_in_the_table_with_its_type_and_labels(name):
    kind, labels = registered_metrics()[name]
    documented = documented_metrics()
    assert name in documented, f"{name} is exposed but not in docs/metrics.md"
    assert documented[name][:2] == (kind, labels)


def test_every_modelplane_row_of_the_table_names_a_metric_the_code_registers():
    registered = registered_metrics()
    stale = [name for name in documented_metrics() if name.startswith("modelplane_") and name not in registered]
    assert stale == []


def test_the_labels_marked_as_target_labels_are_the_ones_the_targets_writer_attaches():
    replica = Replica("a-r1-0", "a-r1", "http://127.0.0.1:1", True, "ready")
    groups = target_groups({}, [replica], {"a-r1": ("a", "pyfunc")}, "127.0.0.1:2")
    [replica] = groups[TARGET_FILES["modelplane-replica"]]
    assert set(replica["labels"]) == TARGET_LABELS
    for name, (_, _, target) in documented_metrics().items():
        if name.startswith(("modelplane_pyfunc_", "vllm:")):
            assert target == TARGET_LABELS, name
        elif name != "up":
            assert target == set(), name


def test_the_recording_rules_on_the_page_are_the_ones_prometheus_loads():
    assert documented_rules() == [(rule.record, rule.expr) for rule in RECORDING_RULES]


# -- the generated configuration ---------------------------------------------------------------

def _promtool() -> str:
    found = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing (apt-get install prometheus)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def test_the_generated_configuration_passes_promtool(tmp_path):
    config = write_config(tmp_path / "prometheus")
    checked = subprocess.run([_promtool(), "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 12 rules found" in checked.stdout + checked.stderr  # 8 recording rules, 4 alerts
    assert "WARNING" not in checked.stdout + checked.stderr  # the targets files exist (empty) from the start


def test_each_scrape_job_reads_the_file_the_targets_writer_writes(tmp_path):
    written = set(target_groups({}, [], {}, "127.0.0.1:1"))
    jobs = {job["job_name"]: Path(job["file_sd_configs"][0]["files"][0]).name
            for job in config_document(tmp_path)["scrape_configs"]}
    assert jobs == TARGET_FILES and set(jobs.values()) == written


def test_a_targets_file_is_replaced_whole_and_only_when_it_changed(tmp_path):
    path = tmp_path / "replicas.json"
    groups = [{"targets": ["127.0.0.1:42000"], "labels": {"endpoint": "gec"}}]
    assert write_if_changed(path, groups) is True
    modified = path.stat().st_mtime_ns
    assert write_if_changed(path, groups) is False and path.stat().st_mtime_ns == modified
    assert write_if_changed(path, []) is True
    assert json.loads(path.read_text()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["replicas.json"]


def test_prometheus_is_a_service_of_up_only_with_the_flag_and_listens_on_loopback(tmp_path):
    from controlplane.platform import Platform
    from controlplane.services import build_services

    settings = Settings.from_env({"MODELPLANE_HOME": str(tmp_path), "MODELPLANE_PROMETHEUS_PORT": "9191",
                                  "MODELPLANE_HOST": "0.0.0.0"})
    assert not [s for s in build_services(settings) if s.name.startswith("prometheus")]
    with_flag = settings.model_copy(update={"prometheus": True})
    services = {s.name: s for s in build_services(with_flag)}
    assert services["prometheus"].port == 9191 and services["prometheus"].url == "http://127.0.0.1:9191"
    assert services["prometheus"].argv[-2:] == ["--port", "9191"]
    assert "controlplane.prometheus_targets" in services["prometheus-targets"].argv
    assert Platform(with_flag).urls()["Prometheus"] == "http://127.0.0.1:9191"
    assert "Prometheus" not in Platform(settings).urls()


# -- the dashboard -----------------------------------------------------------------------------

PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                   "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric and rule names a PromQL expression reads (not functions, labels or keywords)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[match.end():].lstrip().startswith("(") or match.group() in PROMQL_KEYWORDS:
            continue
        names.add(match.group())
    return names


@pytest.mark.parametrize("expr, names", [
    ('sum by (endpoint, le) (rate(x_bucket{code=~"5..", endpoint=~"$endpoint"}[1m]))', {"x_bucket"}),
    ("a:b:rate1m / on (endpoint) (sum by (endpoint) (c * on (endpoint, revision) d{state=\"ready\"}) > 0)",
     {"a:b:rate1m", "c", "d"}),
    ("histogram_quantile(0.99, vllm:e2e_request_latency_seconds_bucket) and bool up",
     {"vllm:e2e_request_latency_seconds_bucket", "up"}),
])
def test_metric_names_finds_the_series_an_expression_reads(expr, names):
    assert metric_names(expr) == names


def dashboard_expressions() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    found = [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel["targets"]]
    for variable in board["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            metric = re.fullmatch(r"label_values\(([^,]+),\s*\w+\)", query["query"]).group(1)
            found.append((f"variable {variable['name']}", metric))
    return found


def allowed_names() -> set[str]:
    allowed = {rule for rule, _ in documented_rules()}
    for name, (kind, _, _) in documented_metrics().items():
        allowed |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return allowed


def test_every_dashboard_query_reads_only_metrics_and_rules_on_the_page():
    allowed = allowed_names()
    unknown = [(title, name) for title, expr in dashboard_expressions() for name in metric_names(expr) - allowed]
    assert unknown == []


def test_the_dashboard_has_the_panels_an_operator_needs_each_with_a_query():
    board = json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in board["panels"] if panel["targets"]}
    assert {"Requests/s", "p99 latency vs SLO", "Errors", "In flight and queued", "Utilization",
            "Replicas ready vs desired", "Autoscaler decisions", "Inference log: records lost"} <= titles
    assert len({panel["id"] for panel in board["panels"]}) == len(board["panels"])


def test_every_dashboard_query_is_valid_promql(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": expr.replace("$endpoint", ".*")}
        for i, (_, expr) in enumerate(dashboard_expressions())]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    checked = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


# -- the control plane's metrics on a real database ------------------------------------------------

def test_the_exporter_reports_replicas_desired_counts_and_the_autoscalers_decisions(migrated_engine):
    from sqlalchemy.orm import Session

    from cluster.hardware import detect_local
    from cluster.local.backend import LocalCluster
    from controlplane.revisions import RevisionStore
    from controlplane.scaling import ScalingStore
    from controlplane.schema import ReplicaRow
    from controlplane.specs import EndpointSpec
    from controlplane.store import EndpointStore

    EndpointStore(migrated_engine).put(EndpointSpec.model_validate({
        "name": "gec", "model": "models:/gec@champion", "slo": {"p99_latency_ms": 500},
        "scaling": {"min_replicas": 1, "max_replicas": 4, "target_concurrency": 6}}))
    revisions = RevisionStore(migrated_engine)
    revision = revisions.create("gec", "gec.v3", "/models/gec/v3", "pyfunc", {}, 2)
    revisions.route("gec", revision.id)
    with Session(migrated_engine) as session, session.begin():
        session.add(ReplicaRow(id=f"{revision.id}-0", revision_id=revision.id, host="127.0.0.1", port=42000, pid=None,
                               state="ready", restarts=1, updated_at=datetime.now(timezone.utc)))
    ScalingStore(migrated_engine).record("gec", revision.id, "horizontal", rule="scale-up", reason="5 in flight",
                                         inputs={}, replicas=2)

    snapshot = read_snapshot(migrated_engine, LocalCluster(migrated_engine).replicas(), detect_local().key)
    registry = CollectorRegistry()
    registry.register(StateCollector(lambda: snapshot))
    text = generate_latest(registry).decode()

    r = revision.id
    for line in [f'modelplane_replicas{{endpoint="gec",revision="{r}",state="ready"}} 1.0',
                 f'modelplane_replicas{{endpoint="gec",revision="{r}",state="starting"}} 0.0',
                 f'modelplane_replica_restarts_total{{endpoint="gec",replica="{r}-0",revision="{r}"}} 1.0',
                 f'modelplane_revision_desired_replicas{{endpoint="gec",revision="{r}"}} 2.0',
                 'modelplane_endpoint_slo_p99_seconds{endpoint="gec"} 0.5',
                 'modelplane_autoscaler_min_replicas{endpoint="gec"} 1.0',
                 'modelplane_autoscaler_max_replicas{endpoint="gec"} 4.0',
                 f'modelplane_autoscaler_target_concurrency{{endpoint="gec",revision="{r}"}} 6.0',
                 f'modelplane_autoscaler_decision_replicas{{endpoint="gec",revision="{r}",rule="scale-up"}} 2.0']:
        assert line in text, line
    assert 'modelplane_autoscaler_decision_timestamp_seconds{axis="horizontal",endpoint="gec"}' in text


# -- a running platform ------------------------------------------------------------------------

def _skip_without_prometheus() -> None:
    if find_prometheus_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is missing (scripts/system-packages.sh installs it)")
        pytest.skip("prometheus is not installed (apt-get install prometheus)")


def _query(prometheus_url: str, promql: str) -> list[dict]:
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": promql}, timeout=10)
    response.raise_for_status()
    return response.json()["data"]["result"]


@pytest.mark.slow
def test_up_with_prometheus_scrapes_the_platform_and_evaluates_the_recording_rules(tmp_path):
    """Prometheus started by `up --prometheus` finds the router and the control-plane exporter
    through the targets files and scrapes them (``up == 1``); requests to an endpoint that does
    not exist, which the router answers and counts under ``endpoint="-"``, come out of the
    request-rate recording rule within a few 5 s evaluations."""
    _skip_without_prometheus()
    from benchmarks.reliability.platform import RunningPlatform

    running = RunningPlatform(tmp_path / "home", None, "--prometheus", env={
        "MODELPLANE_IMAGES": "off", "MODELPLANE_WARM_POOL": "0"})
    prometheus = running.url("prometheus")
    try:
        running.wait_up()
        assert prometheus in running.log()
        for job in ("modelplane-router", "modelplane-control-plane"):
            wait_for(lambda job=job: [r for r in _query(prometheus, f'up{{job="{job}"}}') if r["value"][1] == "1"],
                     60, f"Prometheus to scrape {job}")

        def rule_has_a_value() -> list[dict]:
            for _ in range(5):
                httpx.post(f"{running.url('router')}/serving-endpoints/no-such-endpoint/invocations", json={},
                           timeout=10)
            return [r for r in _query(prometheus, 'endpoint:modelplane_router_requests:rate1m{endpoint="-"}')
                    if float(r["value"][1]) > 0]

        wait_for(rule_has_a_value, 90, "the request-rate rule to count the router's answers", interval_s=2)
        targets = json.loads((tmp_path / "home" / "prometheus" / "targets" / "routers.json").read_text())
        assert len(targets[0]["targets"]) == 1  # the router's own port, not the shared one
    finally:
        running.close()
