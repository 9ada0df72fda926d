"""The local cluster backend for real: the supervisor runs pyfunc replicas of an MLflow model
(``quick_model_dir`` in tests/conftest.py: what is tested is what starts, watches and stops them)."""

import contextlib
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from cluster.local.backend import LocalCluster
from cluster.local.supervisor import Supervisor, SupervisorConfig, plan, restart_delay_s
from serving.runtime.liveness import LivenessConfig
from cluster.protocol import RevisionSpec
from tests.conftest import wait_for

pytestmark = pytest.mark.slow



# Short liveness thresholds so that a hang is found in seconds (the defaults: 30, 60, 30 s).
QUICK_LIVENESS = LivenessConfig(idle_probe_after_s=2.0, hang_after_s=3.0, probe_timeout_s=2.0, unanswered_after_s=3.0)


@pytest.fixture
def supervise(database_url, tmp_path):
    """Start a supervisor with a given config, on SQLite and on PostgreSQL; stopped (and its
    replicas with it) after the test."""
    from controlplane import db

    db.upgrade(database_url)
    engine = db.make_engine(database_url)
    started = []

    def start(config: SupervisorConfig):
        supervisor = Supervisor(engine, tmp_path / "logs", config)
        stop = threading.Event()
        thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
        thread.start()
        started.append((stop, thread))
        return LocalCluster(engine), supervisor

    yield start
    for stop, thread in started:
        stop.set()
        thread.join(60)
    engine.dispose()


@pytest.fixture
def running(supervise):
    return supervise(SupervisorConfig(restart_backoff_initial_s=0.2))


def ready(cluster, revision_id, count):
    return lambda: (lambda rs: rs if sum(r.ready for r in rs) == count else None)(cluster.replicas(revision_id))


def predict(url: str) -> httpx.Response:
    return httpx.post(f"{url}/invocations", json={"dataframe_split": {"columns": ["x"], "data": [[1.0]]}},
                      timeout=10)


def test_plan_and_backoff_are_pure():  # plan's cases: tests/test_replica_plan.py
    assert plan({"r": 2}, set()) == (["r-0", "r-1"], [])
    assert plan({"r": 1}, {"r-0", "r-1"}, {"r": ["r-0"]}) == ([], ["r-0"])
    assert [restart_delay_s(n, 0.5, 4.0) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 4.0, 4.0]


def test_replicas_start_get_ready_restart_after_sigkill_and_stop(running, quick_model_dir, monkeypatch):
    cluster, supervisor = running
    monkeypatch.setenv("MODELPLANE_DATABASE_URL", "postgresql://modelplane:s3cret@db.internal/modelplane")
    cluster.apply(RevisionSpec("svc-r1", "svc", str(quick_model_dir), "pyfunc", replicas=2))
    replicas = wait_for(ready(cluster, "svc-r1", 2), 120, "two ready replicas")
    assert all(predict(r.url).status_code == 200 for r in replicas)
    for managed in supervisor.replicas.values():  # model code never sees the control plane's secrets
        environ = open(f"/proc/{managed._process.pid}/environ", "rb").read()
        assert b"MODELPLANE_DATABASE_URL" not in environ and b"s3cret" not in environ

    victim = replicas[0]
    pid = supervisor.replicas[victim.replica_id]._process.pid
    os.kill(pid, signal.SIGKILL)
    # Out of the ready set while it restarts …
    wait_for(lambda: not next(r for r in cluster.replicas("svc-r1") if r.replica_id == victim.replica_id).ready,
             30, "the killed replica to leave the ready set")
    # … and back, restarted once, answering again.
    back = wait_for(lambda: [r for r in cluster.replicas("svc-r1") if r.replica_id == victim.replica_id
                             and r.ready and r.restarts == 1], 120, "the restarted replica")[0]
    assert predict(back.url).status_code == 200

    cluster.scale("svc-r1", 1)
    wait_for(lambda: [r.replica_id for r in cluster.replicas("svc-r1")] == ["svc-r1-0"], 60, "scale down to one")
    pids = [m._process.pid for m in supervisor.replicas.values()]
    cluster.delete("svc-r1")
    wait_for(lambda: cluster.replicas("svc-r1") == [], 60, "the revision's replicas to go")
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=20)
    assert alive == []


def test_a_model_logged_with_neither_an_example_nor_a_signature_is_ready_once_loaded(supervise, quick_model_dir,
                                                                                    tmp_path):
    """Nothing says what it takes, so no warm-up request: loaded (its /health) is ready, and an
    idle one stays alive with no probe to send (it used to be restarted about once a second)."""
    from tests.conftest import copy_without_example_or_signature

    bare = copy_without_example_or_signature(quick_model_dir, tmp_path / "bare")
    cluster, supervisor = supervise(SupervisorConfig(restart_backoff_initial_s=0.2, liveness_interval_s=0.2,
                                                     liveness=QUICK_LIVENESS))
    cluster.apply(RevisionSpec("bare-r1", "bare", str(bare), "pyfunc", replicas=1))
    [replica] = wait_for(ready(cluster, "bare-r1", 1), 120, "a ready replica")
    time.sleep(2 * QUICK_LIVENESS.idle_probe_after_s)  # idle past the point where a probe would be sent
    [still] = cluster.replicas("bare-r1")
    assert still.ready and still.restarts == 0
    assert predict(replica.url).status_code == 200


def test_a_stopped_engine_with_work_outstanding_is_found_hung_and_restarted(supervise, quick_model_dir):
    cluster, supervisor = supervise(SupervisorConfig(restart_backoff_initial_s=0.2, liveness_interval_s=0.2,
                                                     liveness=QUICK_LIVENESS))
    cluster.apply(RevisionSpec("svc-r1", "svc", str(quick_model_dir), "pyfunc", replicas=1))
    [replica] = wait_for(ready(cluster, "svc-r1", 1), 120, "a ready replica")
    group = supervisor.replicas[replica.replica_id]._process.pid
    os.killpg(group, signal.SIGSTOP)  # a real hang: the process is alive, nothing moves
    try:
        with pytest.raises(httpx.HTTPError):
            predict(replica.url)  # stuck behind the stopped process
        back = wait_for(lambda: [r for r in cluster.replicas("svc-r1") if r.ready and r.restarts == 1], 60,
                        "the hung replica to be restarted")[0]
    finally:
        try:
            os.killpg(group, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert not psutil.pid_exists(group) or psutil.Process(group).status() == psutil.STATUS_ZOMBIE
    assert predict(back.url).status_code == 200


def test_an_error_in_a_watcher_restarts_the_replica_instead_of_ending_the_watch(running, quick_model_dir, monkeypatch):
    cluster, supervisor = running
    cluster.apply(RevisionSpec("svc-r1", "svc", str(quick_model_dir), "pyfunc", replicas=1))
    [replica] = wait_for(ready(cluster, "svc-r1", 1), 120, "a ready replica")
    managed = supervisor.replicas[replica.replica_id]
    calls = []
    real_progress = managed.runtime.progress

    def progress_failing_once(text):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a scrape the parser chokes on")
        return real_progress(text)

    monkeypatch.setattr(managed.runtime, "progress", progress_failing_once)
    back = wait_for(lambda: [r for r in cluster.replicas("svc-r1") if r.ready and r.restarts == 1], 60,
                    "the replica to come back after the watcher error")[0]
    assert managed.watching and supervisor.replicas[replica.replica_id] is managed
    assert predict(back.url).status_code == 200


def test_a_watcher_that_is_gone_is_replaced_by_the_reconcile_loop(running, quick_model_dir):
    cluster, supervisor = running
    cluster.apply(RevisionSpec("svc-r1", "svc", str(quick_model_dir), "pyfunc", replicas=1))
    [replica] = wait_for(ready(cluster, "svc-r1", 1), 120, "a ready replica")
    lost = supervisor.replicas[replica.replica_id]
    old_pid = lost._process.pid
    lost._thread = threading.Thread(target=lambda: None)  # a watcher thread that has ended
    lost._thread.start()
    lost._thread.join()
    wait_for(lambda: supervisor.replicas.get(replica.replica_id) not in (None, lost), 30, "a new watcher")
    wait_for(ready(cluster, "svc-r1", 1), 120, "the replica ready again")
    # the unwatched process was stopped, not left running beside the new one
    assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE
    # … and the lost watcher, were it still running, starts no process of its own again
    threading.Event().wait(2 * 0.2 + 1)  # past its restart back-off (running: 0.2 s initial)
    assert lost._process.pid == old_pid


def test_a_status_write_through_a_locked_database_lands_once_the_lock_goes(sqlite_url, tmp_path, quick_model_dir):
    """The replica dies while another connection holds SQLite's write lock (and the supervisor's
    busy timeout is short): its writes fail, are retried, and land; it never stays marked ready."""
    import sqlite3

    from sqlalchemy import create_engine

    from controlplane import db

    db.upgrade(sqlite_url)
    engine = create_engine(sqlite_url, connect_args={"timeout": 0.2})
    supervisor = Supervisor(engine, tmp_path / "logs", SupervisorConfig(restart_backoff_initial_s=0.2))
    stop = threading.Event()
    thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    thread.start()
    cluster = LocalCluster(db.make_engine(sqlite_url))
    try:
        cluster.apply(RevisionSpec("svc-r1", "svc", str(quick_model_dir), "pyfunc", replicas=1))
        [replica] = wait_for(ready(cluster, "svc-r1", 1), 120, "a ready replica")
        pid = supervisor.replicas[replica.replica_id]._process.pid
        lock = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), timeout=1)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            os.kill(pid, signal.SIGKILL)
            threading.Event().wait(3)  # the supervisor's writes fail meanwhile
        finally:
            lock.rollback()
            lock.close()
        wait_for(lambda: [r for r in cluster.replicas("svc-r1") if not r.ready], 30, "the killed replica unready")
        back = wait_for(lambda: [r for r in cluster.replicas("svc-r1") if r.ready and r.restarts == 1], 120,
                        "the restarted replica")[0]
        assert predict(back.url).status_code == 200
    finally:
        stop.set()
        thread.join(60)
        engine.dispose()


def two_ready_replicas(crashed: Supervisor, cluster: LocalCluster):
    """Reconcile the supervisor that will crash by hand until both of svc-r1's replicas are ready."""
    def reconciled_ready():
        crashed.reconcile_once()
        return ready(cluster, "svc-r1", 2)()

    return wait_for(reconciled_ready, 120, "two ready replicas")


def test_a_new_supervisor_adopts_the_healthy_replicas_of_one_that_crashed(supervise, quick_model_dir, database_url, tmp_path):
    from controlplane import db

    engine = db.make_engine(database_url)
    crashed = Supervisor(engine, tmp_path / "logs", SupervisorConfig())
    cluster = LocalCluster(engine)
    cluster.apply(RevisionSpec("svc-r1", "svc", str(quick_model_dir), "pyfunc", replicas=2))

    before = {r.replica_id: r for r in two_ready_replicas(crashed, cluster)}
    pids = {rid: m._process.pid for rid, m in crashed.replicas.items()}
    leaders = [psutil.Process(pid) for pid in pids.values()]  # who they are, should a pid be reused later
    for managed in crashed.replicas.values():  # the supervisor dies; its replica processes do not
        managed._stop.set()
    os.kill(pids["svc-r1-1"], signal.SIGKILL)  # … except this one, which a new supervisor must restart

    _, supervisor = supervise(SupervisorConfig(restart_backoff_initial_s=0.2))
    try:
        check_adoption(supervisor, cluster, pids, before)
    finally:
        kill_groups(leaders)  # whatever the test left of the crashed supervisor's replicas
        engine.dispose()


def kill_groups(leaders: list[psutil.Process]) -> None:
    """SIGKILL the process groups these replicas lead, if they are still those processes: a pid
    that died earlier may lead another test's group by now (the suite runs on parallel workers)."""
    for leader in leaders:
        if leader.is_running():  # psutil compares the start time: False for a reused pid
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader.pid, signal.SIGKILL)  # replicas lead their own process group


def check_adoption(supervisor, cluster, pids, before) -> None:
    def restarted():
        managed = supervisor.replicas.get("svc-r1-1")
        process = managed and managed._process
        return process and process.pid != pids["svc-r1-1"] and [
            r for r in cluster.replicas("svc-r1") if r.replica_id == "svc-r1-1" and r.ready]

    wait_for(restarted, 120, "the dead replica started again")
    adopted = supervisor.replicas["svc-r1-0"]
    assert adopted._process.pid == pids["svc-r1-0"]  # the same process: not restarted
    [survivor] = [r for r in cluster.replicas("svc-r1") if r.replica_id == "svc-r1-0"]
    assert survivor.ready and survivor.url == before["svc-r1-0"].url and survivor.restarts == 0
    assert predict(survivor.url).status_code == 200


def test_a_new_supervisor_adopts_the_replica_a_victim_left_behind_without_renaming_it(sqlite_url, tmp_path, quick_model_dir):
    """A scale-down that named replica 0 leaves replica 1 alone; a restarted supervisor keeps it
    (the same process, the same id) instead of stopping it to run replica 0 again."""
    from controlplane import db

    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    crashed = Supervisor(engine, tmp_path / "logs", SupervisorConfig())
    cluster = LocalCluster(engine)
    cluster.apply(RevisionSpec("svc-r1", "svc", str(quick_model_dir), "pyfunc", replicas=2))

    two_ready_replicas(crashed, cluster)
    cluster.scale("svc-r1", 1, victims=["svc-r1-0"])
    crashed.reconcile_once()  # stops the victim, and waits for it
    assert [r.replica_id for r in cluster.replicas("svc-r1")] == ["svc-r1-1"]
    pid = crashed.replicas["svc-r1-1"]._process.pid
    leader = psutil.Process(pid)
    crashed.replicas["svc-r1-1"]._stop.set()  # the supervisor dies; its replica process does not

    supervisor = Supervisor(engine, tmp_path / "logs", SupervisorConfig(restart_backoff_initial_s=0.2))
    try:
        supervisor.adopt_previous_run()
        supervisor.reconcile_once()
        assert set(supervisor.replicas) == {"svc-r1-1"}
        wait_for(lambda: supervisor.replicas["svc-r1-1"]._process is not None, 10, "the adopted life to begin")
        assert supervisor.replicas["svc-r1-1"]._process.pid == pid  # adopted, not restarted
        [survivor] = wait_for(ready(cluster, "svc-r1", 1), 30, "the adopted replica ready")
        assert survivor.replica_id == "svc-r1-1" and predict(survivor.url).status_code == 200
    finally:
        supervisor.stop_all()
        kill_groups([leader])
        engine.dispose()


LISTENER = "import os, socket, time; s = socket.socket(); s.bind(('127.0.0.1', int(os.environ['PORT']))); " \
           "s.listen(); print('listening', flush=True); time.sleep(60)"


def test_an_adoptable_replica_process_names_its_port_or_listens_on_it(tmp_path):
    """A cold start has its port on its command line; a replica forked from a zygote whose
    environment lacks setproctitle keeps the zygote's, and is found by its listening socket."""
    import subprocess
    import sys

    from cluster.local.adoption import replica_process
    from cluster.local.replica import free_port

    port, other = free_port("127.0.0.1"), free_port("127.0.0.1")
    named = subprocess.Popen([sys.executable, "-c", LISTENER, "--port", str(port)], stdout=subprocess.PIPE,
                             env={**os.environ, "PORT": str(port)})
    hidden = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE,
                              env={**os.environ, "PORT": str(other)})
    try:
        named.stdout.readline(), hidden.stdout.readline()
        assert replica_process(named.pid, port)
        assert str(other) not in " ".join(psutil.Process(hidden.pid).cmdline())  # only its socket tells
        assert replica_process(hidden.pid, other)
        assert not replica_process(hidden.pid, port)  # a reused pid serving another port is not it
        assert not replica_process(None, port)
    finally:
        named.kill(), hidden.kill()
        named.wait(), hidden.wait()
    assert not replica_process(named.pid, port)  # gone


def test_a_model_that_cannot_load_fails_the_wait_with_its_own_error_not_a_restart_loop(quick_model_dir, sqlite_url,
                                                                                       tmp_path):
    """A deterministic configuration error (here the model's loader module does not exist):
    the replica exits while starting, its row says why (the end of its output), and a deploy
    step waiting for it gives up after a few restarts with that reason, not after 15 minutes
    with "see the logs"; the revision's deletion then ends the restarts."""
    import shutil
    from pathlib import Path

    import yaml

    from assets.served_endpoint import RolloutDriver
    from assets.rollout import WaitReady
    from controlplane import db
    from controlplane.revisions import RevisionStore

    broken = Path(shutil.copytree(quick_model_dir, tmp_path / "broken"))
    mlmodel = yaml.safe_load((broken / "MLmodel").read_text())
    mlmodel["flavors"]["python_function"]["loader_module"] = "no_such_loader_module"
    (broken / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    supervisor, stop = Supervisor(engine, tmp_path / "logs", SupervisorConfig(restart_backoff_initial_s=0.2)), \
        threading.Event()
    thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    thread.start()
    try:
        cluster = LocalCluster(engine)
        cluster.apply(RevisionSpec("bad-r1", "bad", str(broken), "pyfunc", replicas=1))
        driver = RolloutDriver(cluster, RevisionStore(engine), log=print, wait_ready_timeout_s=300, poll_s=0.2)
        started = time.monotonic()
        assert driver.wait_ready(WaitReady("bad-r1", 1)) is False
        assert time.monotonic() - started < 120 and driver.crash_loop
        assert "times without becoming ready" in driver.not_ready
        assert "No module named 'no_such_loader_module'" in driver.not_ready, driver.not_ready
        [replica] = cluster.replicas("bad-r1")
        assert "exited with code" in replica.last_error and "no_such_loader_module" in replica.last_error
        cluster.delete("bad-r1")
        wait_for(lambda: not supervisor.replicas, 60, "the supervisor to stop restarting it")
    finally:
        stop.set()
        thread.join(60)
        engine.dispose()
