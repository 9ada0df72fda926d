"""``modelplane status`` and ``modelplane logs``: the tables from fixed rows (golden), and both
commands on a real control-plane database with a router answering ``/metrics`` over a socket
and replica log files on disk."""

from __future__ import annotations

import json
import math
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from controlplane import db
from controlplane.replica_logs import Tail, follow, last_lines, replica_logs
from controlplane.revisions import RevisionStore
from controlplane.routers import RouterStore
from controlplane.scaling import ScalingStore
from controlplane.schema import ReplicaRow
from controlplane.specs import parse_spec
from controlplane.splits import Share as SplitShare
from controlplane.splits import SplitStore
from controlplane.status_view import (ENDPOINT_HEADERS, REVISION_HEADERS, Decision, EndpointCounters, EndpointStatus,
                                      RevisionStatus, Share, Traffic, endpoint_rows, revision_rows, target_of,
                                      traffic_by_endpoint)
from controlplane.store import EndpointStore
from serving.router.metrics import Metrics

# -- the tables, from plain data ---------------------------------------------------------------


def test_endpoint_table_is_one_row_per_endpoint_by_name_with_the_slo_marked_and_the_target_source_named():
    endpoints = [
        EndpointStatus("iris", 50.0, "iris-v1-0a0b0c0d", "v1", ready_replicas=1, desired_replicas=1,
                       traffic=Traffic(0.04, 12.0, p99_since_start=True), target=8, target_source="cost model"),
        EndpointStatus("gec", 1000.0, "gec-v2-1a2b3c4d", "v2", canary=Share("gec-v3-5e6f7a8b", "v3", 10),
                       shadow=Share("gec-v4-9a9b9c9d", "v4", 5), ready_replicas=2, desired_replicas=3,
                       traffic=Traffic(12.5, 1450.0), target=6,
                       target_source="autoscaler: slo-headroom — p99 310 ms < 0.8 × 1000 ms SLO"),
        EndpointStatus("new", 300.0),
    ]
    assert ENDPOINT_HEADERS == ("endpoint", "serving", "split", "replicas", "req/s", "p99 ms", "SLO ms", "target",
                                "target source")
    assert endpoint_rows(endpoints) == [
        ("gec", "gec-v2-1a2b3c4d (v2)", "canary v3 10%; shadow v4 5%", "2/3", "12", "1450 (over)", "1000", "6",
         "autoscaler: slo-headroom — p99 310 ms < 0.8 × 1000 ms SLO"),
        ("iris", "iris-v1-0a0b0c0d (v1)", "-", "1/1", "0.04", "12* (under)", "50", "8", "cost model"),
        ("new", "- (no revision serves it)", "-", "-", "-", "-", "300", "-", "-"),
    ]


def test_no_router_answer_shows_no_load_rather_than_zero():
    row, = endpoint_rows([EndpointStatus("gec", 1000.0, "gec-v1-1a2b3c4d", "v1", ready_replicas=1,
                                         desired_replicas=1, traffic=None, target=4, target_source="cost model")])
    assert row[4:6] == ("-", "-")


def test_revision_table_puts_serving_then_canary_then_shadow_then_the_rest_per_endpoint():
    rows = revision_rows([
        RevisionStatus("iris", "iris-v1-0a0b0c0d", "v1", "serving", "serving", 100, 1, 1),
        RevisionStatus("gec", "gec-v1-0f0f0f0f", "v1", "draining", None, None, 1, 0),
        RevisionStatus("gec", "gec-v4-9a9b9c9d", "v4", "ready", "shadow", 5, 1, 1),
        RevisionStatus("gec", "gec-v3-5e6f7a8b", "v3", "ready", "canary", 10, 0, 1),
        RevisionStatus("gec", "gec-v2-1a2b3c4d", "v2", "serving", "serving", 90, 2, 3),
    ])
    assert REVISION_HEADERS == ("endpoint", "revision", "version", "state", "traffic", "replicas")
    assert rows == [
        ("gec", "gec-v2-1a2b3c4d", "v2", "serving", "serving 90%", "2/3"),
        ("gec", "gec-v3-5e6f7a8b", "v3", "ready", "canary 10%", "0/1"),
        ("gec", "gec-v4-9a9b9c9d", "v4", "ready", "shadow copy 5%", "1/1"),
        ("gec", "gec-v1-0f0f0f0f", "v1", "draining", "-", "1/0"),
        ("iris", "iris-v1-0a0b0c0d", "v1", "serving", "serving 100%", "1/1"),
    ]


@pytest.mark.parametrize("pinned, cost_model, decision, expected", [
    (None, 4.0, None, (4.0, "cost model")),
    (None, 4.0, Decision(6.0, "slo-breach", "p99 1450 ms > 1000 ms SLO"),
     (6.0, "autoscaler: slo-breach — p99 1450 ms > 1000 ms SLO")),
    (2.0, 4.0, Decision(6.0, "slo-breach", "ignored: the spec pins it"), (2.0, "spec (pinned)")),
    (None, None, None, (1.0, "default: no cost model yet")),
])
def test_target_concurrency_and_where_it_came_from(pinned, cost_model, decision, expected):
    assert target_of(pinned, cost_model, decision) == expected


def test_a_router_that_restarted_between_scrapes_counts_from_zero():
    before = {"gec": EndpointCounters(500, {0.1: 500, math.inf: 500})}
    after = {"gec": EndpointCounters(4, {0.1: 4, math.inf: 4})}  # restarted: 4 answers since
    assert traffic_by_endpoint([(before, after, 2.0)]) == {"gec": Traffic(2.0, 99.0)}


def test_scrape_counts_the_routers_that_answer_and_names_the_one_that_did_not():
    import httpx

    from controlplane.cli_status import scrape_traffic

    scrapes = {"http://a": iter(['modelplane_router_requests_total{code="200",endpoint="gec"} 10\n',
                                 'modelplane_router_requests_total{code="200",endpoint="gec"} 16\n'])}
    times = iter([100.0, 102.0])

    def fetch(url: str) -> str:
        base = url.removesuffix("/metrics")
        if base not in scrapes:
            raise httpx.ConnectError("connection refused")
        return next(scrapes[base])

    traffic, silent = scrape_traffic({"r1": "http://a", "r2": "http://b"}, 2.0, fetch, sleep=lambda _s: None,
                                     clock=lambda: next(times))
    assert traffic == {"gec": Traffic(3.0, None)}
    assert silent == ["r2 at http://b: connection refused"]


# -- status on a real database, with a router answering /metrics over a socket -----------------


class FakeRouter:
    """A router's ``/metrics`` (the router's own Metrics registry) on a real socket: every scrape
    first counts 10 more answers to gec, 9 under 0.25 s and one of 0.4 s."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        router = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                for latency_s in [0.2] * 9 + [0.4]:
                    router.metrics.requests.labels("gec", "200").inc()
                    router.metrics.latency.labels("gec").observe(latency_s)
                body = generate_latest(router.metrics.registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A MODELPLANE_HOME whose control-plane database is migrated and empty."""
    home = tmp_path / "home"
    monkeypatch.setenv("MODELPLANE_HOME", str(home))
    monkeypatch.delenv("MODELPLANE_DATABASE_URL", raising=False)
    monkeypatch.setenv("MODELPLANE_CLUSTER", "local")
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps tables at the terminal width
    db.upgrade(f"sqlite:///{home / 'controlplane.db'}")
    return home


@pytest.fixture
def platform(home):
    """gec serves v1 with a 10% canary of v2 (one of three replicas ready, an autoscaler target
    decision), iris has a spec and no revision, and one live router answers /metrics."""
    engine = db.make_engine(f"sqlite:///{home / 'controlplane.db'}")
    specs = EndpointStore(engine)
    specs.put(parse_spec("name: gec\nmodel: models:/gec@champion\nslo:\n  p99_latency_ms: 300\n"))
    specs.put(parse_spec("name: iris\nmodel: models:/iris@champion\n"))
    revisions = RevisionStore(engine)
    serving = revisions.create("gec", "gec.v1", "/models/gec/v1", "vllm", {}, 3, details={"target_concurrency": 4})
    canary = revisions.create("gec", "gec.v2", "/models/gec/v2", "vllm", {}, 1, details={"target_concurrency": 8})
    revisions.set_state(serving.id, "serving")
    revisions.set_state(canary.id, "ready")
    revisions.route("gec", serving.id)
    SplitStore(engine).set("gec", canary=SplitShare(canary.id, 10.0))
    now = datetime.now(timezone.utc)
    with Session(engine) as session, session.begin():
        for index, (revision_id, state) in enumerate([(serving.id, "ready"), (serving.id, "starting"),
                                                      (canary.id, "ready")]):
            session.add(ReplicaRow(id=f"{revision_id}-{index}", revision_id=revision_id, host="127.0.0.1",
                                   port=9000 + index, pid=None, state=state, restarts=0, updated_at=now))
    ScalingStore(engine).record("gec", serving.id, "vertical", rule="slo-headroom",
                                reason="p99 120 ms < 0.8 × 300 ms SLO", inputs={}, target=6.0)
    router = FakeRouter()
    RouterStore(engine).report("127.0.0.1:8080:1", now, url=router.url)
    yield {"serving": serving.id, "canary": canary.id, "engine": engine}
    router.close()
    engine.dispose()


def status(*args: str):
    from controlplane.cli import app

    return CliRunner().invoke(app, ["status", "--sample-s", "0.1", *args])


def table_lines(output: str, title: str) -> list[list[str]]:
    """The header and body rows of the rich table titled ``title``, as lists of cell texts."""
    lines = output.splitlines()
    start = [line.strip() for line in lines].index(title)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("└"):
            break
        if line.startswith(("┃", "│")):  # the header's bars are heavy, the body's light
            rows.append([cell.strip() for cell in line.strip("┃│").replace("┃", "│").split("│")])
    return rows


def test_status_of_a_running_platform(platform):
    result = status()

    assert result.exit_code == 0, result.output
    header, *rows = table_lines(result.output, "Endpoints")
    assert header == list(ENDPOINT_HEADERS)
    assert [row[0] for row in rows] == ["gec", "iris"]
    gec, iris = rows
    assert gec[1:4] == [f"{platform['serving']} (v1)", "canary v2 10%", "1/3"]
    assert float(gec[4]) > 0  # 10 answers between the scrapes
    # 10 answers between the two scrapes, 9 under 0.25 s: p99 = 0.25 + 0.25 × 0.9 = 0.475 s, over 300 ms
    assert gec[5:] == ["475 (over)", "300", "6", "autoscaler: slo-headroom — p99 120 ms < 0.8 × 300 ms SLO"]
    assert iris == ["iris", "- (no revision serves it)", "-", "-", "-", "-", "1000", "-", "-"]

    header, *rows = table_lines(result.output, "Revisions")
    assert header == list(REVISION_HEADERS)
    assert rows == [["gec", platform["serving"], "v1", "serving", "serving 90%", "1/3"],
                    ["gec", platform["canary"], "v2", "ready", "canary 10%", "1/1"]]


def test_in_a_terminal_too_narrow_for_the_table_each_endpoint_is_a_block_of_lines_with_nothing_cut(platform,
                                                                                                   monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = status()

    assert result.exit_code == 0, result.output
    assert all(len(line.rstrip()) <= 80 for line in result.output.splitlines())
    lines = [line.rstrip() for line in result.output.splitlines()]
    blocks = [lines[i:i + len(ENDPOINT_HEADERS)] for i, line in enumerate(lines) if line.startswith("endpoint ")]
    assert [block[0].split() for block in blocks] == [["endpoint", "gec"], ["endpoint", "iris"]]
    assert blocks[1][1].split(None, 1) == ["serving", "- (no revision serves it)"]
    assert blocks[0][8].split(None, 2)[2] == "autoscaler: slo-headroom — p99 120 ms < 0.8 × 300 ms SLO"
    header, *rows = table_lines(result.output, "Revisions")  # narrow enough to stay a table
    assert header == list(REVISION_HEADERS) and len(rows) == 2


def test_status_json_and_one_endpoint(platform):
    result = status("--endpoint", "gec", "--json")

    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["routers"] == {"live": 1, "answered": 1}
    gec, = data["endpoints"]
    assert (gec["name"], gec["serving_revision"], gec["ready_replicas"], gec["desired_replicas"]) == \
        ("gec", platform["serving"], 1, 3)
    assert gec["traffic"]["p99_ms"] == 475.0 and gec["target"] == 6.0
    assert [(r["revision_id"], r["role"], r["percent"]) for r in data["revisions"]] == \
        [(platform["serving"], "serving", 90.0), (platform["canary"], "canary", 10.0)]


def test_a_decision_outside_the_sweep_shows_the_target_the_autoscaler_holds_within_it(platform):
    """After a re-measure narrowed the sweep, the newest decision can lie outside it: the
    controller clamps it when it loads the window, and status and the metrics say so."""
    ScalingStore(platform["engine"]).record("gec", platform["serving"], "vertical", rule="slo-headroom",
                                            reason="p99 40 ms < 0.8 × 300 ms SLO", inputs={}, target=64.0)
    gec, = json.loads(status("--endpoint", "gec", "--json").output)["endpoints"]
    assert gec["target"] == 16.0  # the spec's default sweep ends at 16
    assert gec["target_source"].endswith("(held within the swept concurrency)")


def test_status_of_an_unknown_endpoint_is_a_usage_error(platform):
    result = status("--endpoint", "nope")
    assert result.exit_code == 2
    assert "no endpoint named 'nope'" in result.output


def test_status_says_to_start_the_platform_when_no_database_exists(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELPLANE_HOME", str(tmp_path / "never-started"))
    monkeypatch.delenv("MODELPLANE_DATABASE_URL", raising=False)
    result = status()
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1 and "`modelplane up`" in result.output
    assert not (tmp_path / "never-started").exists()  # status created nothing


def test_status_says_what_to_do_when_the_database_cannot_be_reached(monkeypatch):
    from tests.conftest import free_port

    monkeypatch.setenv("MODELPLANE_DATABASE_URL", f"postgresql://modelplane:secret@127.0.0.1:{free_port()}/modelplane")
    result = status()
    assert result.exit_code == 1
    line, = result.output.strip().splitlines()
    assert "cannot read the control-plane database" in line and "`modelplane up`" in line
    assert "secret" not in line and "modelplane:***@" in line


def test_status_says_to_start_the_platform_when_no_router_runs(home):
    result = status()
    assert result.exit_code == 1
    assert "modelplane is not running" in result.output and "`modelplane up`" in result.output


# -- logs ---------------------------------------------------------------------------------------


def logs(*args: str):
    from controlplane.cli import app

    return CliRunner().invoke(app, ["logs", *args])


def write_log(home: Path, replica_id: str, lines: list[str]) -> Path:
    path = home / "logs" / "replicas" / f"{replica_id}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_logs_prints_each_routed_replicas_last_lines_prefixed_with_its_id(platform, home):
    serving, canary = platform["serving"], platform["canary"]
    write_log(home, f"{serving}-0", ["loading", "ready on 9000", "POST /v1/chat/completions 200"])
    write_log(home, f"{serving}-1", ["loading"])
    write_log(home, f"{canary}-0", ["canary ready"])
    write_log(home, "gec-v0-deadbeef-0", ["an older revision: not shown"])

    result = logs("gec", "--lines", "2")

    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"{serving}-0 | ready on 9000", f"{serving}-0 | POST /v1/chat/completions 200",
        f"{serving}-1 | loading",
        f"{canary}-0 | canary ready",
    ]


def test_logs_of_an_endpoint_nothing_serves_shows_its_newest_revision(home):
    engine = db.make_engine(f"sqlite:///{home / 'controlplane.db'}")
    EndpointStore(engine).put(parse_spec("name: gec\nmodel: models:/gec@champion\n"))
    failed = RevisionStore(engine).create("gec", "gec.v1", "/m", "vllm", {}, 1)
    RevisionStore(engine).set_state(failed.id, "failed")
    engine.dispose()
    write_log(home, f"{failed.id}-0", ["CUDA out of memory"])

    result = logs("gec")

    assert result.exit_code == 0, result.output
    assert f"no revision serves gec; showing its newest, {failed.id} (failed)" in result.output
    assert f"{failed.id}-0 | CUDA out of memory" in result.output


def test_logs_of_an_unknown_endpoint_is_a_usage_error(home):
    result = logs("nope")
    assert result.exit_code == 2
    assert "no endpoint named 'nope'" in result.output and "modelplane endpoints list" in result.output


def test_replica_log_files_are_found_by_revision_then_index(tmp_path):
    for name in ("gec-v1-aaaaaaaa-10", "gec-v1-aaaaaaaa-2", "gec-v1-aaaaaaaa-x", "gec-v1-aaaaaaaab-0"):
        (tmp_path / f"{name}.log").write_text("")
    assert [rid for rid, _ in replica_logs(tmp_path, ["gec-v1-aaaaaaaa"])] == ["gec-v1-aaaaaaaa-2",
                                                                              "gec-v1-aaaaaaaa-10"]


def test_last_lines_of_a_log_larger_than_one_read_block(tmp_path):
    path = tmp_path / "big.log"
    path.write_text("".join(f"line {i}\n" for i in range(20_000)))  # about 200 kB
    assert last_lines(path, 3) == ["line 19997", "line 19998", "line 19999"]
    assert len(last_lines(path, 15_000)) == 15_000


def test_follow_prints_new_lines_of_known_and_newly_started_replicas(tmp_path):
    first = tmp_path / "gec-v1-aaaaaaaa-0.log"
    first.write_text("old line\n")
    tail = Tail()
    tail.add("gec-v1-aaaaaaaa-0", first)
    second = tmp_path / "gec-v1-aaaaaaaa-1.log"
    writes = iter([
        lambda: first.open("a").write("half"),  # no newline yet: held back
        lambda: first.open("a").write(" a line\n"),
        lambda: second.write_text("scaled up\n"),  # a replica that started meanwhile, read from its start
        lambda: first.write_text("rotated\n"),  # truncated: read from the start again
    ])
    polls = []

    def sleep(_s: float) -> None:
        polls.append(1)
        next(writes, lambda: None)()

    lines = list(follow(tail, lambda: replica_logs(tmp_path, ["gec-v1-aaaaaaaa"]), lambda: len(polls) >= 6,
                        sleep, discover_every=1))

    assert lines == [("gec-v1-aaaaaaaa-0", "half a line"), ("gec-v1-aaaaaaaa-1", "scaled up"),
                     ("gec-v1-aaaaaaaa-0", "rotated")]


def test_logs_run_prints_the_newest_runs_event_log_with_its_error(platform, home, monkeypatch):
    """``--run`` reads Dagster's own storage: two runs of gec versions executed here, the newer failing."""
    from dagster import DagsterInstance, job, op

    from controlplane.settings import REPO_ROOT

    dagster_home = home / "dagster"
    dagster_home.mkdir(parents=True)
    (dagster_home / "dagster.yaml").write_text((REPO_ROOT / "dagster.yaml").read_text())

    @op(config_schema={"fail": bool})
    def served_endpoint(context) -> None:
        context.log.info("rolling out behind a 10% canary")
        if context.op_config["fail"]:
            raise RuntimeError("canary p99 1450 ms over the 300 ms SLO")

    @job
    def deploy() -> None:
        served_endpoint()

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))  # restored afterwards, though `logs` sets it too
    instance = DagsterInstance.from_config(str(dagster_home))
    try:
        for partition, fail in (("gec.v1", False), ("gec.v2", True), ("gecko.v9", False)):
            deploy.execute_in_process(instance=instance, tags={"dagster/partition": partition}, raise_on_error=False,
                                      run_config={"ops": {"served_endpoint": {"config": {"fail": fail}}}})
    finally:
        instance.dispose()

    result = logs("gec", "--run", "--lines", "200")

    assert result.exit_code == 0, result.output
    assert "of gec.v2 (deploy, failure)" in result.output  # gecko is another model, however new its run
    lines = result.output.splitlines()
    assert any(line.endswith("served_endpoint  rolling out behind a 10% canary") for line in lines)
    assert any("ERROR" in line and "canary p99 1450 ms over the 300 ms SLO" in line for line in lines)

    assert logs("gec", "--run", "--lines", "1").output.count("\n") == 2  # the run line and one event
    assert not any(" DEBUG " in line for line in lines)  # Dagster's own step events, unless asked for
    everything = logs("gec", "--run", "--lines", "200", "--level", "debug").output.splitlines()
    assert any(" DEBUG " in line for line in everything) and len(everything) > len(lines)
    only_errors = logs("gec", "--run", "--level", "error").output.splitlines()[1:]
    assert only_errors and all(" ERROR " in line for line in only_errors)


# -- progress ------------------------------------------------------------------------------------


def test_waiting_prints_its_step_once_when_not_on_a_terminal():
    from io import StringIO

    from rich.console import Console

    from controlplane.progress import waiting

    out = StringIO()
    console = Console(file=out, force_terminal=False)
    with waiting(console, "waiting for the deploy runs") as describe:
        describe("deploy runs: gec.v1 started")  # no frames, no second line
        console.print("  gec.v1: run 1a2b3c4d started")
    assert out.getvalue().splitlines() == ["waiting for the deploy runs…", "  gec.v1: run 1a2b3c4d started"]


def test_waiting_on_a_terminal_shows_the_step_and_its_elapsed_time_and_leaves_no_trace():
    from io import StringIO

    from rich.console import Console

    from controlplane.progress import waiting

    out = StringIO()
    console = Console(file=out, force_terminal=True, width=80)
    with waiting(console, "starting the platform") as describe:
        describe("deploy runs: gec.v1 started")
        console.print("mlflow is up")
    text = out.getvalue()
    assert "mlflow is up" in text and "0:00:0" in text  # the elapsed column
    assert "deploy runs: gec.v1 started" in text
