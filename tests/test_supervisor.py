"""The local cluster backend for real: the supervisor runs pyfunc replicas of the iris model."""

import os
import signal
import threading

import httpx
import psutil
import pytest

from cluster.local.backend import LocalCluster
from cluster.local.supervisor import Supervisor, SupervisorConfig, plan, restart_delay_s
from cluster.protocol import RevisionSpec
from tests.conftest import wait_for

pytestmark = pytest.mark.slow
COLUMNS = ["sepal length (cm)", "sepal width (cm)", "petal length (cm)", "petal width (cm)"]



@pytest.fixture(scope="module")
def iris_dir(tmp_path_factory):
    from mlflow import MlflowClient

    from demo.iris import log_iris
    from pipelines.registry import MlflowRegistry

    root = tmp_path_factory.mktemp("iris")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).create_experiment("modelplane-demo", artifact_location=(root / "a").as_uri())
    log_iris(uri)
    return MlflowRegistry(uri).download("iris", "1", root / "model")


@pytest.fixture
def running(sqlite_url, tmp_path):
    from controlplane import db

    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    supervisor = Supervisor(engine, tmp_path / "logs", SupervisorConfig(restart_backoff_initial_s=0.2))
    stop = threading.Event()
    thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    thread.start()
    yield LocalCluster(engine), supervisor
    stop.set()
    thread.join(60)
    engine.dispose()


def ready(cluster, revision_id, count):
    return lambda: (lambda rs: rs if sum(r.ready for r in rs) == count else None)(cluster.replicas(revision_id))


def predict(url: str) -> httpx.Response:
    return httpx.post(f"{url}/invocations", json={"dataframe_split": {"columns": COLUMNS, "data": [[5.1, 3.5, 1.4, 0.2]]}},
                      timeout=10)


def test_plan_and_backoff_are_pure():
    assert plan({"r": 2}, set()) == (["r-0", "r-1"], [])
    assert plan({"r": 1}, {"r-0", "r-1"}) == ([], ["r-1"])
    assert [restart_delay_s(n, 0.5, 4.0) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 4.0, 4.0]


def test_replicas_start_get_ready_restart_after_sigkill_and_stop(running, iris_dir):
    cluster, supervisor = running
    cluster.apply(RevisionSpec("iris-r1", "iris", str(iris_dir), "pyfunc", replicas=2))
    replicas = wait_for(ready(cluster, "iris-r1", 2), 120, "two ready replicas")
    assert all(predict(r.url).status_code == 200 for r in replicas)

    victim = replicas[0]
    pid = supervisor.replicas[victim.replica_id]._process.pid
    os.kill(pid, signal.SIGKILL)
    # Out of the ready set while it restarts …
    wait_for(lambda: not next(r for r in cluster.replicas("iris-r1") if r.replica_id == victim.replica_id).ready,
             30, "the killed replica to leave the ready set")
    # … and back, restarted once, answering again.
    back = wait_for(lambda: [r for r in cluster.replicas("iris-r1") if r.replica_id == victim.replica_id
                             and r.ready and r.restarts == 1], 120, "the restarted replica")[0]
    assert predict(back.url).status_code == 200

    cluster.scale("iris-r1", 1)
    wait_for(lambda: [r.replica_id for r in cluster.replicas("iris-r1")] == ["iris-r1-0"], 60, "scale down to one")
    pids = [m._process.pid for m in supervisor.replicas.values()]
    cluster.delete("iris-r1")
    wait_for(lambda: cluster.replicas("iris-r1") == [], 60, "the revision's replicas to go")
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=20)
    assert alive == []
