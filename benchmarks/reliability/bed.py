"""One platform for the whole fault table: ``modelplane up`` with two routers, on a fresh
PostgreSQL database reached through a :class:`DbGate` (so that the database can be made
unreachable), serving three endpoints:

- ``iris``: the scikit-learn demo model on the pyfunc runtime, three replicas, every request
  in the inference log; deployed as a user deploys it (the spec through the CLI, the model
  registered over MLflow's REST API, MLflow's webhook, the Dagster deploy run);
- ``smol``: SmolLM2-135M-Instruct on vLLM, one replica of ``SMOL_MEMORY_GIB`` (its KV cache
  sized within it, not from half the machine), at most ``SMOL_RUNNING`` requests running and
  ``SMOL_QUEUED`` queued per router;
- ``slow``: a pyfunc model with a known service time (100 ms a row, one at a time), 1-3
  replicas at a target concurrency of 2: what the autoscaler fault scales.

``smol`` and ``slow`` skip the deploy pipeline (quantization, eval gate, cost sweep: not
what these faults exercise): their revisions are written and routed the way a rollout does,
and the platform's own supervisor starts their replicas and its routers route to them.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sqlalchemy import create_engine, select, text
from sqlalchemy.orm import Session

from benchmarks.polling import wait_for
from benchmarks.reliability.dbgate import DbGate
from benchmarks.reliability.load import Target
from benchmarks.reliability.platform import IRIS_REQUEST, REGISTER_IRIS, RunningPlatform
from cluster.local.backend import LocalCluster
from cluster.protocol import RevisionSpec
from controlplane import db
from controlplane.revisions import RevisionStore
from controlplane.schema import ReplicaRow

POSTGRES_ADMIN_URL = os.environ.get("MODELPLANE_TEST_POSTGRES_URL",
                                    "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
IRIS_SPEC = """name: iris
model: models:/iris@champion
quantization: {scheme: none}
slo: {p99_latency_ms: 200}
cost_model: {concurrency: [1, 4], max_point_s: 3}
scaling: {min_replicas: 3, max_replicas: 3}
inference_log: {sample_rate: 1.0}
"""
ROUTERS = 2  # ``modelplane up --routers``: both listen on one port, the kernel splits connections
SMOL_RUNNING, SMOL_QUEUED = 4, 4  # what each router admits to ``smol`` at once
SMOL_MEMORY_GIB = 4  # weights, two processes and a 1 GiB KV cache (46,000 tokens): what its faults need
SMOL_SPEC = f"""name: smol
model: models:/smol@champion
scaling: {{min_replicas: 1, max_replicas: 1}}
replica: {{memory_gib: {SMOL_MEMORY_GIB}}}
routing: {{max_concurrent_requests: {SMOL_RUNNING}, max_queued_requests: {SMOL_QUEUED}, max_queue_wait_s: 10}}
"""
SLOW_SPEC = """name: slow
model: models:/slow@champion
slo: {p99_latency_ms: 2000}
scaling: {min_replicas: 1, max_replicas: 3, target_concurrency: 2}
"""
SLOW_BODY = {"dataframe_split": {"columns": ["x"], "data": [[1.0]]}}


@dataclass(frozen=True)
class ReplicaState:
    replica_id: str
    state: str
    pid: int | None
    restarts: int


class FaultBed:
    def __init__(self, root: Path, log: Callable[[str], None] = print, env: dict[str, str] | None = None) -> None:
        self.root, self.log, self.env = root, log, env or {}
        self.work = root / "loops"
        self.database = f"modelplane_faults_{uuid.uuid4().hex[:10]}"
        self._admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with self._admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{self.database}"'))
        base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0]
        self.database_url = f"{base}/{self.database}"  # the harness's own view: never through the gate
        host_port = base.rsplit("@", 1)[-1]
        host, port = host_port.rsplit(":", 1)
        self.gate = DbGate(host, int(port))
        self.gate.start()
        self.gated_url = self.gate.url(self.database_url)
        self.engine = db.make_engine(self.database_url)
        self.platform: RunningPlatform | None = None
        self.targets: dict[str, Target] = {}

    # -- set-up ------------------------------------------------------------------------------
    def start(self) -> "FaultBed":
        started = time.monotonic()
        self.platform = RunningPlatform(self.root / "home", self.gated_url, "--routers", str(ROUTERS),
                                        env=self.env).wait_up()
        self.log(f"platform up in {time.monotonic() - started:.0f} s")
        self.admin_token = self._admin_token()
        # smol's and slow's replicas start while iris goes through its deploy run
        smol = self._start_direct("smol", SMOL_SPEC, self._smol_model_dir(), "vllm", {"context_tokens": 8192})
        slow = self._start_direct("slow", SLOW_SPEC, self._slow_model_dir(), "pyfunc", {"cold_start_s": 5.0},
                                  runtime_config={"max_batch_size": 1, "workers": 1})
        self._deploy_iris()
        self._when_ready("smol", smol, "vllm")
        self._when_ready("slow", slow, "pyfunc")
        self.log(f"three endpoints serving after {time.monotonic() - started:.0f} s")
        return self

    def _admin_token(self) -> str:
        created = self.platform.cli("tokens", "create", "--admin", "--description", "fault table")
        if created.returncode != 0:
            raise RuntimeError(created.stderr)
        token = created.stdout.strip().splitlines()[-1]
        self.platform.created_tokens.append(token)
        return token

    def _create_endpoint(self, name: str, spec: str) -> None:
        path = self.root / f"{name}.yaml"
        path.write_text(spec)
        created = self.platform.cli("endpoints", "create", "-f", str(path))
        if created.returncode != 0:
            raise RuntimeError(f"endpoints create {name}: {created.stderr}")

    def _target(self, name: str, path: str, body: dict) -> Target:
        token = self.platform.token(name)
        target = Target(name, f"{self.platform.url('router')}{path}", body, {"Authorization": f"Bearer {token}"})
        self.targets[name] = target
        return target

    def _deploy_iris(self) -> None:
        self._create_endpoint("iris", IRIS_SPEC)
        self.platform.register(REGISTER_IRIS)
        run = self.platform.finished_run("iris.v1", 600)
        if run["status"] != "SUCCESS":
            raise RuntimeError(f"the iris deploy run ended {run['status']}")
        self._target("iris", "/serving-endpoints/iris/invocations", IRIS_REQUEST)
        wait_for(lambda: self.ready("iris") == 3, 120, "three ready iris replicas")

    def _start_direct(self, name: str, spec: str, model_dir: Path, runtime: str, details: dict,
                      runtime_config: dict | None = None) -> str:
        """The endpoint and a revision of ``model_dir``, routed at once (no run owns it, and the
        revision reaper retires what nothing routes to), its replicas started by the platform's
        supervisor; returns the revision's id (:meth:`_when_ready` waits for them)."""
        from controlplane.specs import parse_spec

        self._create_endpoint(name, spec)
        parsed = parse_spec(spec)
        config = runtime_config or parsed.replica.model_dump()
        revisions = RevisionStore(self.engine)
        revision = revisions.create(name, f"{name}.v1", str(model_dir), runtime, config,
                                    parsed.scaling.min_replicas, details)
        LocalCluster(self.engine).apply(RevisionSpec(revision.id, name, str(model_dir), runtime,
                                                     parsed.scaling.min_replicas, config))
        revisions.route(name, revision.id)
        return revision.id

    def _when_ready(self, name: str, revision_id: str, runtime: str) -> None:
        wait_for(lambda: self.ready(name, revision_id) >= 1, 900, f"a ready {name} replica", interval_s=1.0)
        if runtime == "vllm":
            body = {"model": name, "prompt": "Fix the grammar: she go to school.", "max_tokens": 8}
            self._target(name, "/v1/completions", body)
        else:
            self._target(name, f"/serving-endpoints/{name}/invocations", SLOW_BODY)

    def _smol_model_dir(self) -> Path:
        from benchmarks.runtime_vs_vllm import smollm2_model_dir

        return smollm2_model_dir()

    def _slow_model_dir(self) -> Path:
        from demo.service_time_model import save_service_time_model

        return save_service_time_model(self.root / "slow-model", 100.0)

    # -- what the scenarios read -------------------------------------------------------------
    def serving(self, endpoint: str) -> str:
        return RevisionStore(self.engine).traffic()[endpoint]

    def replicas(self, endpoint: str, revision_id: str | None = None) -> list[ReplicaState]:
        revision_id = revision_id or self.serving(endpoint)
        with Session(self.engine) as session:
            rows = session.scalars(select(ReplicaRow).where(ReplicaRow.revision_id == revision_id,
                                                            ReplicaRow.state != "stopped").order_by(ReplicaRow.id))
            return [ReplicaState(r.id, r.state, r.pid, r.restarts) for r in rows]

    def ready(self, endpoint: str, revision_id: str | None = None) -> int:
        return sum(1 for r in self.replicas(endpoint, revision_id) if r.state == "ready")

    def desired(self, endpoint: str) -> int:
        return RevisionStore(self.engine).get(self.serving(endpoint)).desired_replicas

    def close(self) -> None:
        try:
            if self.platform is not None:
                self.platform.close()
        finally:
            self.gate.close()
            self.engine.dispose()
            with self._admin.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)'))
            self._admin.dispose()
