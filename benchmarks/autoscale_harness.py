"""The autoscaler for real, on one machine: supervisor, router and controller around pyfunc replicas.

What ``tests/test_autoscale_live.py`` and ``benchmarks/autoscale_local.py`` drive. One SQLite
control-plane database; the local backend's supervisor in a thread, starting real replica
processes; a real router (uvicorn) in a thread; the controller in a thread with its real
adapters (routers' ``/internal/in-flight``, replicas' ``/metrics``, ``LocalCluster.scale``,
the decisions table, the lease) on the wall clock. Every endpoint serves
``demo.service_time_model``: each row costs a known service time, so a replica with one
worker and ``max_batch_size`` 1 answers ``1000 / service_time_ms`` rows per second however
busy the cores are, and latency at ``c`` requests in flight is about ``c × service_time_ms``.

    platform = Platform(tmp, ControllerConfig(scale_down_window_s=20.0))
    slow = platform.deploy("name: slow\\nmodel: models:/slow@champion\\n...")
    platform.start_controller()
    stop, answers = threading.Event(), []
    pool = steady_load(slow, 6, stop, answers)
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import httpx
import uvicorn

from benchmarks.polling import wait_for  # noqa: F401 - benchmarks.autoscale_local imports it from here
from autoscale.controller.loop import Controller, ControllerConfig
from autoscale.controller.sources import ReplicaMetrics, RouterLoad, read_plans, replica_counts
from cluster.local.backend import LocalCluster
from cluster.local.supervisor import Supervisor, SupervisorConfig, free_port
from cluster.protocol import RevisionSpec
from controlplane import db
from controlplane.revisions import RevisionStore
from controlplane.routers import RouterStore
from controlplane.scaling import Lease, ScalingStore
from controlplane.specs import parse_spec
from controlplane.store import EndpointStore
from controlplane.tokens import TokenStore
from serving.router.app import create_app
from serving.router.config import RouterConfig
from serving.router.table import load_table

HARDWARE = "cpu/test"
SERVICE_TIME_MS = 100.0  # a replica (one worker, max_batch_size 1) answers 10 rows per second
BODY = {"dataframe_split": {"columns": ["x"], "data": [[1.0]]}}  # one row
ONE_AT_A_TIME = {"max_batch_size": 1, "workers": 1}


class WallClock:
    """The controller's clock: wall time, as ``python -m autoscale.controller`` uses."""

    def now_s(self) -> float:
        return time.time()


class Answer(NamedTuple):
    """One request of a load loop: when it was sent (wall clock), its status (0: no answer), its
    latency, and for a failure the start of the answer (or the exception)."""

    sent_s: float
    status: int
    latency_s: float
    error: str = ""


@dataclass
class Deployed:
    """One endpoint served by the platform: its serving revision and how to call it."""

    name: str
    revision_id: str
    url: str  # the router's invocations URL
    headers: dict[str, str]
    cold_start_s: float  # apply → first replica ready, measured at deployment
    cluster: LocalCluster

    def ready(self) -> int:
        return sum(r.ready for r in self.cluster.replicas(self.revision_id))

    def served_by(self) -> int:
        """Replicas not stopped: ready, starting or draining."""
        return len(self.cluster.replicas(self.revision_id))

    def replica_urls(self) -> set[str]:
        return {r.url for r in self.cluster.replicas(self.revision_id) if r.ready}


class Platform:
    """Supervisor and router on one SQLite database; endpoints deployed with :meth:`deploy`;
    the controller started with :meth:`start_controller` (so a test can deploy first)."""

    def __init__(self, root: Path, controller_config: ControllerConfig = ControllerConfig(scale_down_window_s=20.0),
                 service_time_ms: float = SERVICE_TIME_MS, log: Callable[[str], None] = lambda _m: None) -> None:
        from demo.service_time_model import save_service_time_model

        self.root, self.controller_config, self._log = root, controller_config, log
        url = f"sqlite:///{root / 'controlplane.db'}"
        db.upgrade(url)
        self.engine = db.make_engine(url)
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.model_dir = save_service_time_model(root / "model", service_time_ms)
        self.revisions, self.cluster = RevisionStore(self.engine), LocalCluster(self.engine)
        self.decisions = ScalingStore(self.engine)
        _, self.admin_token = TokenStore(self.engine).create([], admin=True)
        self._thread(Supervisor(self.engine, root / "logs", SupervisorConfig(restart_backoff_initial_s=0.5)).run,
                     self.stop)
        self._start_router()

    def _thread(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _start_router(self) -> None:
        port = free_port("127.0.0.1")
        self.router_url = f"http://127.0.0.1:{port}"
        routers = RouterStore(self.engine)
        app = create_app(RouterConfig(port=port, refresh_interval_s=0.2, hold_max_s=60.0),
                         lambda: load_table(self.engine, HARDWARE),
                         report=lambda read_at: routers.report("router-1", read_at, self.router_url))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self._thread(self.server.run)
        wait_for(lambda: routers.live_urls(), 20, "the router to report")

    def deploy(self, spec: str, *, details: dict | None = None, runtime_config: dict | None = None) -> Deployed:
        """Store the spec, start one replica of a new revision, route the endpoint to it and wait
        until the router answers for it. The replica's time to ready is recorded on the revision
        as ``cold_start_s`` (as a deployment does), which sizes the router's hold for scale from zero."""
        parsed = parse_spec(spec)
        EndpointStore(self.engine).put(parsed)
        name = parsed.name
        revision = self.revisions.create(name, f"{name}.v1", str(self.model_dir), "pyfunc",
                                         runtime_config or ONE_AT_A_TIME, 1, details or {})
        cold_start_s = self.start_and_time(revision.id, name, revision.runtime_config)
        if "cold_start_s" not in (details or {}):
            self.revisions.add_details(revision.id, cold_start_s=round(cold_start_s, 1))
        self.revisions.route(name, revision.id)
        _, token = TokenStore(self.engine).create([name])
        deployed = Deployed(name, revision.id, f"{self.router_url}/serving-endpoints/{name}/invocations",
                            {"Authorization": f"Bearer {token}"}, cold_start_s, self.cluster)
        wait_for(lambda: httpx.post(deployed.url, json=BODY, headers=deployed.headers, timeout=30).status_code == 200,
                 20, f"the router to serve {name}")
        return deployed

    def start_and_time(self, revision_id: str, endpoint: str, runtime_config: dict | None = None) -> float:
        """Order one replica of ``revision_id`` and return the seconds until it is ready."""
        started = time.monotonic()
        self.cluster.apply(RevisionSpec(revision_id, endpoint, str(self.model_dir), "pyfunc", 1,
                                        runtime_config or ONE_AT_A_TIME))
        wait_for(lambda: sum(r.ready for r in self.cluster.replicas(revision_id)) >= 1, 180,
                 f"a replica of {revision_id}", interval_s=0.05)
        return time.monotonic() - started

    def measure_cold_start(self, endpoint: str) -> float:
        """A fresh replica's time to ready: a revision that takes no traffic (the controller and
        the router leave it alone) started, timed, and removed again."""
        revision_id = f"{endpoint}-coldstart-{time.monotonic_ns()}"
        seconds = self.start_and_time(revision_id, endpoint)
        self.cluster.delete(revision_id)
        wait_for(lambda: not self.cluster.replicas(revision_id), 60, "the cold-start replica to stop")
        return seconds

    def undeploy(self, deployed: Deployed) -> None:
        """Take the endpoint out of the router and stop its replicas."""
        self.revisions.unroute(deployed.name)
        self.cluster.delete(deployed.revision_id)
        wait_for(lambda: not self.cluster.replicas(deployed.revision_id), 60, f"{deployed.name}'s replicas to stop")

    def start_controller(self) -> None:
        cluster = self.cluster
        controller = Controller(
            plans=lambda: read_plans(self.engine, HARDWARE), replicas=lambda rid: replica_counts(cluster, rid),
            load=RouterLoad(RouterStore(self.engine), self.admin_token, log=lambda _m: None), stats=ReplicaMetrics(),
            scale=cluster.scale, recorder=ScalingStore(self.engine),
            is_leader=Lease(self.engine, "autoscaler", "harness", ttl_s=10).acquire, clock=WallClock(),
            config=self.controller_config, log=self._log)

        def loop():
            while not self.stop.is_set():
                controller.tick()
                self.stop.wait(self.controller_config.sample_interval_s)
        self._thread(loop)

    def in_flight(self) -> dict:
        """The router's ``GET /internal/in-flight`` snapshot (``endpoints → replicas → in flight``)."""
        response = httpx.get(f"{self.router_url}/internal/in-flight",
                             headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=5)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self.server.should_exit = True
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        self.engine.dispose()


def steady_load(endpoint: Deployed, concurrency: int, stop: threading.Event, answers: list[Answer],
                body: dict = BODY) -> ThreadPoolExecutor:
    """``concurrency`` closed-loop clients on ``endpoint`` until ``stop`` is set; every answer
    (any status) is appended to ``answers``. ``shutdown()`` the pool after setting ``stop``."""
    def one_client():
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                sent_s, started = time.time(), time.monotonic()
                try:
                    response = client.post(endpoint.url, json=body, headers=endpoint.headers)
                    status, error = response.status_code, "" if response.status_code == 200 else response.text[:300]
                except httpx.HTTPError as exc:  # no answer at all: a failure, never dropped from the record
                    status, error = 0, repr(exc)[:300]
                answers.append(Answer(sent_s, status, time.monotonic() - started, error))
    pool = ThreadPoolExecutor(concurrency)
    for _ in range(concurrency):
        pool.submit(one_client)
    return pool
