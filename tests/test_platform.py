"""`modelplane up` for real: MLflow, Dagster and the admin API on loopback ports.

One platform is started for the module. The tests then check its health, refuse a second
`up`, follow a model registered over MLflow's REST API through MLflow's own signed webhook
to a Dagster deploy run, and finally stop it with SIGTERM and look for leftover processes.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
MODELPLANE = str(Path(sys.executable).parent / "modelplane")
RUNS_QUERY = """query($tags: [ExecutionTag!]) { runsOrError(filter: {tags: $tags}) { ... on Runs { results { runId status
  tags { key value } } } } }"""


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class RunningPlatform:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.ports = {"MODELPLANE_MLFLOW_PORT": free_port(), "MODELPLANE_DAGSTER_PORT": free_port(),
                      "MODELPLANE_ADMIN_PORT": free_port()}
        self.env = {**os.environ, "MODELPLANE_HOME": str(home), **{k: str(v) for k, v in self.ports.items()}}
        self.env.pop("MODELPLANE_DATABASE_URL", None)
        self.env.pop("MLFLOW_TRACKING_URI", None)
        self.output = home / "up.out"
        home.mkdir(parents=True, exist_ok=True)
        with self.output.open("wb") as out:
            self.process = subprocess.Popen([MODELPLANE, "up"], cwd=REPO, env=self.env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.ports[f'MODELPLANE_{service.upper()}_PORT']}"

    def log(self) -> str:
        return self.output.read_text()

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([MODELPLANE, *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    running = RunningPlatform(tmp_path_factory.mktemp("platform") / "home")
    try:
        wait_for(lambda: "modelplane is up" in running.log() or running.process.poll() is not None, 300, "`up`")
        assert running.process.poll() is None, running.log()
        yield running
    finally:
        if running.process.poll() is None:
            for child in psutil.Process(running.process.pid).children(recursive=True):
                child.kill()
            running.process.kill()


def test_up_prints_the_urls_and_every_service_answers(platform):
    log = platform.log()
    for name, service in [("MLflow UI", "mlflow"), ("Dagster UI", "dagster"), ("Admin API", "admin")]:
        assert f"{name}" in log and platform.url(service) in log
    assert httpx.get(f"{platform.url('mlflow')}/health").text.strip() == "OK"
    assert httpx.get(f"{platform.url('admin')}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{platform.url('dagster')}/server_info").status_code == 200


def test_a_second_up_says_it_is_already_running_and_exits_nonzero(platform):
    started = time.monotonic()
    second = platform.cli("up")
    assert second.returncode != 0
    assert "already running" in second.stderr + second.stdout
    assert time.monotonic() - started < 60
    assert platform.process.poll() is None


def test_up_registers_the_webhook_with_mlflow(platform):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=platform.url("mlflow"), registry_uri=platform.url("mlflow"))
    [hook] = [w for w in client.list_webhooks() if w.name == "modelplane-registry"]
    assert hook.url == f"{platform.url('admin')}/webhooks/mlflow"
    assert {str(e) for e in hook.events} == {"model_version.created", "model_version_alias.created"}


def test_registering_a_version_behind_the_alias_starts_one_deploy_run(platform):
    created = platform.cli("endpoints", "create", "-f", "examples/endpoints/iris.yaml")
    assert created.returncode == 0, created.stderr
    # Register through the MLflow server, as a data scientist would.
    register = subprocess.run(
        [sys.executable, "-c", "import sys; from demo.iris import log_iris; v = log_iris(sys.argv[1]);"
         "from mlflow import MlflowClient; MlflowClient(sys.argv[1], sys.argv[1]).set_registered_model_alias("
         "'iris', 'champion', v.version)", platform.url("mlflow")],
        cwd=REPO, env=platform.env, capture_output=True, text=True, timeout=300)
    assert register.returncode == 0, register.stderr[-3000:]

    def runs():
        response = httpx.post(f"{platform.url('dagster')}/graphql", timeout=10, json={
            "query": RUNS_QUERY, "variables": {"tags": [{"key": "dagster/partition", "value": "iris.v1"}]}})
        return response.json()["data"]["runsOrError"]["results"]

    finished = wait_for(lambda: [r for r in runs() if r["status"] in ("SUCCESS", "FAILURE")], 240, "the iris.v1 run")
    assert len(runs()) == 1
    assert finished[0]["status"] == "SUCCESS"
    tags = {t["key"]: t["value"] for t in finished[0]["tags"]}
    assert tags["dagster/partition"] == "iris.v1"
    # MLflow signed the deliveries with the secret `up` gave it, and the admin API accepted them.
    import sqlite3

    with sqlite3.connect(platform.home / "controlplane.db") as connection:
        events = {row[0] for row in connection.execute("SELECT event FROM webhook_inbox WHERE registered_model='iris'")}
    assert events == {"model_version.created", "model_version_alias.created"}
    assert (platform.home / "models" / "iris" / "v1" / "source" / "MLmodel").exists()


def test_sigterm_stops_every_process_it_started(platform):
    parent = psutil.Process(platform.process.pid)
    descendants = parent.children(recursive=True)
    assert len(descendants) >= 4
    platform.process.send_signal(signal.SIGTERM)
    assert platform.process.wait(timeout=90) == 0
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert alive == [], [p.info for p in alive]
    for port in platform.ports.values():
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
