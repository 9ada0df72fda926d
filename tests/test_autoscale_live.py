"""The autoscaler for real: pyfunc replicas with a known service time, a real router, the supervisor.

The controller runs in a thread with its real adapters (routers' ``/internal/in-flight``,
replicas' ``/metrics``, ``LocalCluster.scale``, the decisions table, the lease), with a
20 s scale-down lookback instead of 300 s so that the test takes a minute, not ten.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

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
from tests.conftest import wait_for

pytestmark = pytest.mark.slow
HARDWARE = "cpu/test"
SERVICE_TIME_MS = 100.0  # a replica (one worker) answers 10 rows per second
BODY = {"dataframe_split": {"columns": ["x"], "data": [[1.0]]}}


class WallClock:
    def now_s(self) -> float:
        return time.time()


class Platform:
    """Supervisor, router and controller on one SQLite database; the endpoint ``slow`` served."""

    def __init__(self, root, spec: str) -> None:
        from demo.service_time_model import save_service_time_model

        url = f"sqlite:///{root / 'controlplane.db'}"
        db.upgrade(url)
        self.engine = db.make_engine(url)
        self.stop = threading.Event()
        self.threads = []
        EndpointStore(self.engine).put(parse_spec(spec))
        model_dir = save_service_time_model(root / "model", SERVICE_TIME_MS)
        self.revisions, self.cluster = RevisionStore(self.engine), LocalCluster(self.engine)
        self._thread(Supervisor(self.engine, root / "logs", SupervisorConfig(restart_backoff_initial_s=0.5)).run,
                     self.stop)
        revision = self.revisions.create("slow", "slow.v1", str(model_dir), "pyfunc",
                                         {"max_batch_size": 1, "workers": 1}, 1,
                                         {"target_concurrency": 1, "cold_start_s": 5.0})
        self.revision_id = revision.id
        self.cluster.apply(RevisionSpec(revision.id, "slow", str(model_dir), "pyfunc", 1, revision.runtime_config))
        wait_for(lambda: self.ready() == 1, 120, "the first replica")
        self.revisions.route("slow", revision.id)
        self._start_router()
        self.decisions = ScalingStore(self.engine)
        _, token = TokenStore(self.engine).create(["slow"])
        self.headers = {"Authorization": f"Bearer {token}"}

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

    def start_controller(self) -> None:
        _, admin = TokenStore(self.engine).create([], admin=True)
        cluster = self.cluster
        controller = Controller(
            plans=lambda: read_plans(self.engine, HARDWARE), replicas=lambda rid: replica_counts(cluster, rid),
            load=RouterLoad(RouterStore(self.engine), admin, log=lambda _m: None), stats=ReplicaMetrics(),
            scale=cluster.scale, recorder=ScalingStore(self.engine),
            is_leader=Lease(self.engine, "autoscaler", "test", ttl_s=10).acquire, clock=WallClock(),
            config=ControllerConfig(scale_down_window_s=20.0), log=lambda _m: None)

        def loop():
            while not self.stop.is_set():
                controller.tick()
                self.stop.wait(1.0)
        self._thread(loop)

    def ready(self) -> int:
        return sum(r.ready for r in self.cluster.replicas(self.revision_id))

    def served_by(self) -> int:
        return len(self.cluster.replicas(self.revision_id))

    def close(self) -> None:
        self.server.should_exit = True
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        self.engine.dispose()


def steady_load(platform: Platform, concurrency: int, stop: threading.Event, results: list) -> ThreadPoolExecutor:
    def one_client():
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                started = time.monotonic()
                response = client.post(f"{platform.router_url}/serving-endpoints/slow/invocations", json=BODY,
                                       headers=platform.headers)
                results.append((response.status_code, time.monotonic() - started))
    pool = ThreadPoolExecutor(concurrency)
    for _ in range(concurrency):
        pool.submit(one_client)
    return pool


@pytest.fixture
def platform(tmp_path):
    spec = ("name: slow\nmodel: models:/slow@champion\nslo: {p99_latency_ms: 2000}\n"
            "scaling: {min_replicas: 1, max_replicas: 3, target_concurrency: 2}\n")
    platform = Platform(tmp_path, spec)
    try:
        yield platform
    finally:
        platform.close()


def test_a_load_step_adds_replicas_that_take_traffic_then_idle_removes_them_without_failing_a_request(platform):
    platform.start_controller()
    stop, results = threading.Event(), []
    pool = steady_load(platform, 6, stop, results)  # 6 in flight at a target of 2: 3 replicas
    ordered_at = wait_for(lambda: (d := platform.decisions.latest("slow", "horizontal")) and d.replicas == 3 and d,
                          20, "a scale-up within 20 s")
    wait_for(lambda: platform.ready() == 3, 60, "the added replicas to be ready")
    time.sleep(3)
    served = len(results)
    time.sleep(5)
    stop.set()
    pool.shutdown()
    rate_at_three = (len(results) - served) / 5
    assert ordered_at.rule == "scale-up" and "6" in ordered_at.reason
    assert rate_at_three > 15  # one replica serves 10 rows/s; three in rotation serve close to 30

    light_stop = threading.Event()
    pool = steady_load(platform, 1, light_stop, results)  # 1 in flight: 1 replica is enough
    wait_for(lambda: platform.served_by() == 1, 90, "the scale-down after the 20 s lookback")
    time.sleep(2)
    light_stop.set()
    pool.shutdown()
    down = platform.decisions.latest("slow", "horizontal")
    assert down.replicas == 1 and down.rule == "scale-down"
    assert all(status == 200 for status, _ in results), {s for s, _ in results}


def test_scaled_to_zero_the_next_request_is_held_and_served(tmp_path):
    spec = ("name: slow\nmodel: models:/slow@champion\n"
            "scaling: {min_replicas: 0, max_replicas: 2, target_concurrency: 2, scale_to_zero_grace_s: 5}\n")
    platform = Platform(tmp_path, spec)
    try:
        platform.start_controller()
        wait_for(lambda: platform.served_by() == 0, 90, "scale to zero after the lookback and the grace")
        assert platform.decisions.latest("slow", "horizontal").rule == "scale-to-zero"
        started = time.monotonic()
        response = httpx.post(f"{platform.router_url}/serving-endpoints/slow/invocations", json=BODY,
                              headers=platform.headers, timeout=90)
        waited_s = time.monotonic() - started
        assert response.status_code == 200, response.text
        assert platform.decisions.latest("slow", "horizontal").rule == "from-zero"
        assert waited_s < 60  # held for the cold start, within hold_max_s
    finally:
        platform.close()
