"""``modelplane up`` in a process of its own, driven the way a user drives it.

What the fault scenarios (``benchmarks.reliability``) and ``tests/test_platform.py`` run: the
real services (MLflow, Dagster, the admin API, the supervisor, the routers, the autoscaler,
the registry) on free ports on 127.0.0.1, with helpers to register models over MLflow's REST
API, follow Dagster runs, create tokens with the CLI and find a service's live process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from benchmarks.polling import wait_for
from serving.tls import tls_context
from cluster.local.replica import free_ports

REPO = Path(__file__).resolve().parent.parent.parent
MODELPLANE = str(Path(sys.executable).parent / "modelplane")
RUNS_QUERY = """query($tags: [ExecutionTag!]) { runsOrError(filter: {tags: $tags}) { ... on Runs { results { runId status
  tags { key value } } } } }"""
REGISTER_IRIS = ("import sys; from demo.iris import log_iris; v = log_iris(sys.argv[1]);"
                 "from mlflow import MlflowClient; MlflowClient(sys.argv[1], sys.argv[1]).set_registered_model_alias("
                 "'iris', 'champion', v.version)")
IRIS_REQUEST = {"dataframe_split": {"columns": ["sepal length (cm)", "sepal width (cm)", "petal length (cm)",
                                                "petal width (cm)"], "data": [[5.1, 3.5, 1.4, 0.2]]}}
# Every port `up` listens on, each a free one: platforms started side by side (parallel test
# workers) never meet on a default port.
PORT_SETTINGS = ("MODELPLANE_MLFLOW_PORT", "MODELPLANE_DAGSTER_PORT", "MODELPLANE_ADMIN_PORT", "MODELPLANE_ROUTER_PORT",
                 "MODELPLANE_REGISTRY_PORT", "MODELPLANE_PROMETHEUS_PORT")


class RunningPlatform:
    """``modelplane up [args]`` with its state in ``home``; ``database_url`` None means SQLite there."""

    def __init__(self, home: Path, database_url: str | None = None, *args: str,
                 env: dict[str, str] | None = None) -> None:
        self.home = home
        self.ports = dict(zip(PORT_SETTINGS, free_ports("127.0.0.1", len(PORT_SETTINGS))))
        self.env = {**os.environ, "MODELPLANE_HOME": str(home), **{k: str(v) for k, v in self.ports.items()},
                    **(env or {})}
        self.env.pop("MODELPLANE_DATABASE_URL", None)
        self.database_url = database_url or f"sqlite:///{home / 'controlplane.db'}"
        if database_url:
            self.env["MODELPLANE_DATABASE_URL"] = database_url
        self.env.pop("MLFLOW_TRACKING_URI", None)
        self.output = home / "up.out"
        self.created_tokens: list[str] = []
        home.mkdir(parents=True, exist_ok=True)
        with self.output.open("wb") as out:
            self.process = subprocess.Popen([MODELPLANE, "up", *args], cwd=REPO, env=self.env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self, timeout_s: float = 300) -> "RunningPlatform":
        wait_for(lambda: "modelplane is up" in self.log() or self.process.poll() is not None, timeout_s, "`up`")
        if self.process.poll() is not None:
            raise RuntimeError(f"`modelplane up` exited with {self.process.returncode}:\n{self.log()[-3000:]}")
        return self

    def url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.ports[f'MODELPLANE_{service.upper()}_PORT']}"

    def log(self) -> str:
        return self.output.read_text()

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([MODELPLANE, *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=120)

    def register(self, code: str) -> str:
        """Run registration code (``sys.argv[1]`` is MLflow's URL) in a fresh process, as a data scientist
        would; returns what it printed."""
        registering = self.start_registration(code)
        stdout, stderr = registering.communicate(timeout=300)
        if registering.returncode != 0:
            raise RuntimeError(f"registration failed:\n{stderr[-3000:]}")
        return stdout

    def start_registration(self, code: str) -> subprocess.Popen:
        """:meth:`register`'s process, started and left running (its output on pipes, as text)."""
        return subprocess.Popen([sys.executable, "-c", code, self.url("mlflow")], cwd=REPO, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def runs(self, partition: str) -> list[dict]:
        response = httpx.post(f"{self.url('dagster')}/graphql", timeout=10, verify=tls_context(), json={
            "query": RUNS_QUERY, "variables": {"tags": [{"key": "dagster/partition", "value": partition}]}})
        return response.json()["data"]["runsOrError"]["results"]

    def finished_run(self, partition: str, timeout_s: float) -> dict:
        return wait_for(lambda: [r for r in self.runs(partition) if r["status"] in ("SUCCESS", "FAILURE")],
                        timeout_s, f"the {partition} run")[0]

    def token(self, *endpoints: str) -> str:
        created = self.cli("tokens", "create", *[a for e in endpoints for a in ("--endpoint", e)])
        if created.returncode != 0:
            raise RuntimeError(f"tokens create failed: {created.stderr}")
        value = created.stdout.strip().splitlines()[-1]
        self.created_tokens.append(value)
        return value

    def service_process(self, module: str) -> psutil.Process | None:
        """The live process of a service `up` started (None while there is none)."""
        for process in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if process.status() != psutil.STATUS_ZOMBIE and module in " ".join(process.cmdline()):
                    return process
        return None

    def service_processes(self, module: str) -> list[psutil.Process]:
        """Every live process of services started as ``module`` (the routers: one per router)."""
        found = []
        for process in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if process.status() != psutil.STATUS_ZOMBIE and f"-m {module}" in " ".join(process.cmdline()):
                    found.append(process)
        return found

    def processes(self) -> list[psutil.Process]:
        """Every process `up` started, and the replicas a restarted supervisor adopted (found by their paths)."""
        found = {self.process.pid: psutil.Process(self.process.pid)}
        for process in psutil.Process(self.process.pid).children(recursive=True):
            found[process.pid] = process
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if str(self.home) in " ".join(process.cmdline()):
                    found[process.pid] = process
        return list(found.values())

    def replica_groups(self) -> list[int]:
        """The process groups of the replicas the database knows (each replica leads its own): a
        replica a killed supervisor left behind is nobody's child, and a vLLM replica's engine
        processes name no path of this platform."""
        from sqlalchemy import text

        from controlplane.db import make_engine

        try:
            engine = make_engine(self.database_url)
            try:
                with engine.connect() as connection:
                    return [pid for (pid,) in connection.execute(text("SELECT pid FROM replicas WHERE pid IS NOT NULL"))]
            finally:
                engine.dispose()
        except Exception:  # noqa: BLE001 - no database yet, or not reachable: the path sweep below still runs
            return []

    def close(self) -> None:
        """Kill everything it started, the replicas a restarted supervisor adopted, and their mounts."""
        for group in self.replica_groups():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getsid(group) == group:  # still a session leader: the replica, not a reused pid
                    os.killpg(group, signal.SIGKILL)
        if self.process.poll() is None:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.process.pid).children(recursive=True):
                    child.kill()
            self.process.kill()
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if str(self.home) in " ".join(process.cmdline()):
                    process.kill()
        from images.mounts import sweep_leftovers

        sweep_leftovers(self.home / "images" / "runtime")
