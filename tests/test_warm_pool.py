"""The warm pool and its zygotes: when a zygote may become a replica, what the pool starts and stops,
and real zygotes becoming real replicas (a stand-in module, the pyfunc server, and vLLM when slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import psutil
import pytest

from autoscale.clock import FakeClock
from benchmarks.polling import wait_for
from cluster.local.supervisor import kill_group
from cluster.local.warm_pool import (AssignmentRefused, KeyState, PoolKey, PoolPlan, WarmPool, WarmPoolConfig,
                                     ZygoteView, after_failure, plan)
from serving.runtime.base import ReplicaLaunch, RuntimeConfig
from serving.runtime.process import free_port, replica_environment
from serving.runtime.zygote import KINDS, Assignment, ZygoteFacts, ZygoteKind, preload, refusal
from serving.tls import tls_context

PYTHON = sys.executable
PROBE = "warm_replica_probe"
PROBE_KIND = ZygoteKind(serves=(PROBE,), preload=("json", "http.server"))

# ---- refusal: a zygote becomes a replica only as a cold process would have started it ---------

VLLM_FACTS = ZygoteFacts(
    pid=1, kind="vllm", python="/venv/bin/python", cwd="/srv", serves=("vllm.entrypoints.openai.api_server",),
    pre_import_env={}, import_env={"OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": None},
    import_writes={"KMP_INIT_AT_FORK": "FALSE"}, preload_s=11.0)
VLLM_ARGV = ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"]
VLLM_ENV = {"OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}


@pytest.mark.parametrize("argv, env, cwd, reason", [
    (VLLM_ARGV, VLLM_ENV, "/srv", None),
    # read lazily by vllm.envs, never at import: another value is fine
    (VLLM_ARGV, {**VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}, "/srv", None),
    (["/other/venv/bin/python", *VLLM_ARGV[1:]], VLLM_ENV, "/srv", "python /other/venv/bin/python is not the zygote's"),
    (["/venv/bin/python", "-u", "-m", "vllm.entrypoints.openai.api_server"], VLLM_ENV, "/srv", "argv must be"),
    (["/venv/bin/python", "-m", "serving.runtime.pyfunc"], VLLM_ENV, "/srv",
     "module serving.runtime.pyfunc is not served"),
    (VLLM_ARGV, VLLM_ENV, "/elsewhere", "cwd /elsewhere is not the zygote's /srv"),
    # libgomp sized its pool from OMP_NUM_THREADS when torch loaded
    (VLLM_ARGV, {**VLLM_ENV, "OMP_NUM_THREADS": "1"}, "/srv", "differs from the zygote: OMP_NUM_THREADS"),
    # a native variable the zygote started without
    (VLLM_ARGV, {**VLLM_ENV, "LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "/srv", "differs from the zygote: LD_PRELOAD"),
    # looked up at import and absent then: vLLM's logger is configured already
    (VLLM_ARGV, {**VLLM_ENV, "VLLM_LOGGING_LEVEL": "DEBUG"}, "/srv", "differs from the zygote: VLLM_LOGGING_LEVEL"),
    (VLLM_ARGV, {"OMP_NUM_THREADS": "2"}, "/srv", "differs from the zygote: HF_HUB_OFFLINE"),
])
def test_a_vllm_zygote_refuses_what_a_cold_process_would_not_be(argv, env, cwd, reason):
    got = refusal(Assignment(argv=argv, env=env, cwd=cwd, log_path="/logs/r.log"), VLLM_FACTS)
    assert got is None if reason is None else reason in got


def test_a_refusal_names_variables_but_never_shows_their_values():
    facts = ZygoteFacts(**{**VLLM_FACTS.__dict__, "import_env": {"HF_TOKEN": "hf_secret_1"}})
    got = refusal(Assignment(VLLM_ARGV, {**VLLM_ENV, "HF_TOKEN": "hf_secret_2"}, "/srv", "l"), facts)
    assert "HF_TOKEN" in got and "secret" not in got


PYFUNC_THREADS = {name: "2" for name in KINDS["pyfunc"].required_env}
PYFUNC_FACTS = ZygoteFacts(
    pid=1, kind="pyfunc", python="/venv/bin/python", cwd="/srv", serves=KINDS["pyfunc"].serves,
    pre_import_env=KINDS["pyfunc"].pre_import_env,
    import_env={"MLFLOW_DISABLE_TELEMETRY": "true", **PYFUNC_THREADS}, import_writes={}, preload_s=1.5,
    required_env=KINDS["pyfunc"].required_env)


@pytest.mark.parametrize("env, reason", [
    # main() sets MLFLOW_DISABLE_TELEMETRY=true before importing MLflow; so did the zygote
    (PYFUNC_THREADS, None),
    ({**PYFUNC_THREADS, "MLFLOW_DISABLE_TELEMETRY": "false"}, "MLFLOW_DISABLE_TELEMETRY"),
    # main() would size the thread pools from --workers after numpy had loaded in the zygote
    ({"MLFLOW_DISABLE_TELEMETRY": "true"}, "must set OMP_NUM_THREADS"),
])
def test_a_pyfunc_zygote_applies_mains_defaults_and_needs_thread_counts(env, reason):
    argv = ["/venv/bin/python", "-m", "serving.runtime.pyfunc", "--model-dir", "/m"]
    got = refusal(Assignment(argv, env, "/srv", "l"), PYFUNC_FACTS)
    assert got is None if reason is None else reason in got


def test_preload_records_named_reads_and_writes_but_not_a_copy_of_the_environment(tmp_path, monkeypatch):
    (tmp_path / "reads_env_at_import.py").write_text(textwrap.dedent("""
        import os
        A = os.environ.get("WP_TEST_READ")
        B = "WP_TEST_ABSENT" in os.environ
        COPY = dict(os.environ)  # a copy for a subprocess depends on no single value
        os.environ["WP_TEST_WRITTEN"] = "1"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for i in range(10):  # enough variables for the copy to be told from lookups
        monkeypatch.setenv(f"WP_TEST_FILLER_{i}", "x")
    monkeypatch.setenv("WP_TEST_READ", "yes")
    monkeypatch.setenv("WP_TEST_UNREAD", "no")
    monkeypatch.delenv("WP_TEST_ABSENT", raising=False)
    monkeypatch.delenv("WP_TEST_WRITTEN", raising=False)
    start_env, read, writes = preload(ZygoteKind(serves=(), preload=()), ("reads_env_at_import",))
    assert {"WP_TEST_READ", "WP_TEST_ABSENT"} <= read
    assert not any(name.startswith("WP_TEST_FILLER") or name == "WP_TEST_UNREAD" for name in read)
    assert writes == {"WP_TEST_WRITTEN": "1"}
    assert start_env["WP_TEST_READ"] == "yes"


# ---- plan: what the pool starts and stops, with time passed explicitly ------------------------

KEY = PoolKey("pyfunc", "/venv/bin/python")
CONFIG = WarmPoolConfig(size_per_kind=1, start_timeout_s=60.0, refill_delay_s=30.0)


def view(zygote_id, started_s=0.0, alive=True, ready=True, fits=True, key=KEY):
    return ZygoteView(zygote_id, key, started_s, alive, ready, fits)


@pytest.mark.parametrize("wanted, zygotes, now_s, expected", [
    ({}, [], 0.0, PoolPlan()),  # a kind never used costs nothing
    ({KEY: KeyState({}, not_before_s=30.0)}, [], 29.9, PoolPlan()),  # the refill waits for the start to finish
    ({KEY: KeyState({}, not_before_s=30.0)}, [], 30.0, PoolPlan(start=(KEY,))),
    ({KEY: KeyState({})}, [view(1)], 100.0, PoolPlan()),  # one ready: nothing to do, however often asked
    ({KEY: KeyState({})}, [view(1, ready=False, started_s=50.0)], 100.0, PoolPlan()),  # still importing
    ({KEY: KeyState({})}, [view(1, alive=False)], 5.0, PoolPlan(start=(KEY,), stop=((1, "exited while idle"),))),
    ({KEY: KeyState({})}, [view(1, ready=False, started_s=0.0)], 61.0,
     PoolPlan(start=(KEY,), stop=((1, "not ready within start_timeout_s"),))),
    ({KEY: KeyState({})}, [view(1, fits=False)], 5.0,
     PoolPlan(start=(KEY,), stop=((1, "the key's environment changed"),))),
    ({}, [view(1)], 5.0, PoolPlan(stop=((1, "its key is no longer warmed"),))),
    ({KEY: KeyState({})}, [view(1, started_s=3.0), view(2, ready=False, started_s=1.0)], 5.0,
     PoolPlan(stop=((2, "more than size_per_kind"),))),  # the ready one stays
])
def test_plan(wanted, zygotes, now_s, expected):
    assert plan(wanted, zygotes, now_s, CONFIG) == expected


def test_no_zygote_at_all_with_size_zero():
    config = WarmPoolConfig(size_per_kind=0)
    assert plan({KEY: KeyState({})}, [view(1)], 0.0, config) == PoolPlan(stop=((1, "its key is no longer warmed"),))


@pytest.mark.parametrize("failures, now_s, not_before_s", [(0, 100.0, 105.0), (1, 100.0, 110.0), (9, 100.0, 700.0)])
def test_failed_starts_back_off(failures, now_s, not_before_s):
    config = WarmPoolConfig(failure_backoff_initial_s=5.0, failure_backoff_max_s=600.0)
    state = after_failure(KeyState({}, failures=failures), now_s, config)
    assert (state.not_before_s, state.failures) == (not_before_s, failures + 1)


def test_config_is_checked_when_built():
    with pytest.raises(ValueError, match="size_per_kind must be ≥ 0"):
        WarmPoolConfig(size_per_kind=-1)
    with pytest.raises(ValueError, match="start_timeout_s must be > 0"):
        WarmPoolConfig(start_timeout_s=0)


# ---- real zygotes with a stand-in replica module ----------------------------------------------

PROBE_SOURCE = '''
"""A replica stand-in: says how it was started, prints, starts a child, then serves until killed."""
import json, os, subprocess, sys, time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
report = {"argv": sys.argv, "orig_argv": sys.orig_argv, "env": dict(os.environ), "cwd": os.getcwd(),
          "path0": sys.path[0], "name": __name__, "stdin": os.readlink("/proc/self/fd/0"),
          "affinity": sorted(os.sched_getaffinity(0)), "pid": os.getpid(), "child": child.pid,
          "imported_by_name": "warm_replica_probe" in sys.modules}
print("hello from the replica", flush=True)
with open(sys.argv[1] + ".tmp", "w") as out:
    json.dump(report, out)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
'''


@pytest.fixture
def probe(tmp_path):
    """The stand-in module on a PYTHONPATH of its own; a launch of it names the report file."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{PROBE}.py").write_text(PROBE_SOURCE)

    def launch(report: Path, **env: str) -> ReplicaLaunch:
        return ReplicaLaunch(argv=[PYTHON, "-m", PROBE, str(report)],
                             env={"PYTHONPATH": str(tmp_path / "mods"), "OMP_NUM_THREADS": "1", **env})
    return launch


@pytest.fixture
def pool(tmp_path):
    pool = WarmPool(WarmPoolConfig(refill_delay_s=0.0, poll_interval_s=0.1, start_timeout_s=60.0,
                                   log_dir=tmp_path / "zygotes"), kinds={"probe": PROBE_KIND})
    yield pool
    pool.close()


def ready_pids(pool: WarmPool, key: PoolKey) -> list[int]:
    return [z.process.pid for z in pool._zygotes.values() if z.key == key and z.facts is not None]


def read_report(path: Path) -> dict:
    return json.loads(wait_for(lambda: path.is_file() and path.read_text(), 30, f"{path.name}"))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_warm_replica_starts_as_a_cold_one_would(pool, probe, tmp_path):
    # the zygote starts with the first launch's environment; the warm replica must not keep WP_FIRST_ONLY
    cold_launch = probe(tmp_path / "cold.json", WP_FIRST_ONLY="1")
    first = pool.start("probe", cold_launch, tmp_path / "cold.log")  # the kind's first start is cold
    assert (first.warm, first.reason) == (False, "no warm zygote ready")
    key = PoolKey.for_launch("probe", cold_launch)
    wait_for(lambda: ready_pids(pool, key), 60, "a ready zygote")
    warm_launch = probe(tmp_path / "warm.json", WP_SECOND_ONLY="2")
    warm = pool.start("probe", warm_launch, tmp_path / "warm.log")
    try:
        assert (warm.warm, warm.reason) == (True, None)
        cold_report, warm_report = read_report(tmp_path / "cold.json"), read_report(tmp_path / "warm.json")
        assert warm_report["pid"] == warm.process.pid
        assert os.getsid(warm.process.pid) == warm.process.pid  # its own session, as kill_group expects
        # everything but the report path (and what follows from the pid) is the cold process's
        for field in ("cwd", "path0", "name", "stdin", "affinity", "imported_by_name"):
            assert warm_report[field] == cold_report[field], field
        assert warm_report["env"] == replica_environment(warm_launch.env)  # the assignment's, nothing else
        assert cold_report["env"] == replica_environment(cold_launch.env)
        assert warm_report["argv"] == [cold_report["argv"][0], str(tmp_path / "warm.json")]
        assert warm_report["orig_argv"] == [PYTHON, "-m", PROBE, str(tmp_path / "warm.json")]
        assert (warm_report["name"], warm_report["stdin"]) == ("__main__", "/dev/null")
        assert "hello from the replica" in wait_for(lambda: (tmp_path / "warm.log").read_text(), 10, "the log")
        assert str(tmp_path / "warm.json") in psutil.Process(warm.process.pid).cmdline()  # adoption reads it
    finally:
        kill_group(first.process, grace_s=5)
        kill_group(warm.process, grace_s=5)


def test_kill_group_on_a_warm_replica_stops_it_and_its_children(pool, probe, tmp_path):
    launch = probe(tmp_path / "r.json")
    pool.warm(PoolKey.for_launch("probe", launch), launch.env)
    wait_for(lambda: ready_pids(pool, PoolKey.for_launch("probe", launch)), 60, "a ready zygote")
    started = pool.start("probe", launch, tmp_path / "r.log")
    assert started.warm
    report = read_report(tmp_path / "r.json")
    kill_group(started.process, grace_s=5)
    assert started.process.returncode == -signal.SIGTERM
    wait_for(lambda: gone(report["child"]), 10, "the replica's child to go")


def ignored_signals(pid: int) -> int:
    """The process's SigIgn mask (bit n-1 set: signal n ignored)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigIgn:"))
    return int(line.split()[1], 16)


@pytest.mark.parametrize("warm", [False, True])
def test_a_replica_stops_on_sigterm_even_when_its_starter_ignores_it(pool, probe, tmp_path, warm):
    """An ignored signal survives exec: a replica started by a process that ignores SIGTERM (a CI
    runner did) would ignore it too, and every stop would end in SIGKILL after the grace."""
    launch = probe(tmp_path / "r.json")
    key = PoolKey.for_launch("probe", launch)
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if warm:
            pool.warm(key, launch.env)
            wait_for(lambda: ready_pids(pool, key), 60, "a ready zygote")
        started = pool.start("probe", launch, tmp_path / "r.log")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert started.warm is warm
    read_report(tmp_path / "r.json")
    assert not ignored_signals(started.process.pid) & (1 << (signal.SIGTERM - 1))
    kill_group(started.process, grace_s=5)
    assert started.process.returncode == -signal.SIGTERM


def test_a_refused_assignment_says_why_and_start_falls_back_to_cold(pool, probe, tmp_path):
    launch = probe(tmp_path / "r.json")
    key = PoolKey.for_launch("probe", launch)
    pool.warm(key, launch.env)
    wait_for(lambda: ready_pids(pool, key), 60, "a ready zygote")
    # another thread count than the zygote's: libgomp and BLAS would already be sized
    other_threads = probe(tmp_path / "threads.json", OMP_NUM_THREADS="2")
    started = pool.start("probe", other_threads, tmp_path / "threads.log")
    try:
        assert not started.warm
        assert started.reason == "environment read at import differs from the zygote: OMP_NUM_THREADS"
        assert read_report(tmp_path / "threads.json")["env"]["OMP_NUM_THREADS"] == "2"  # it ran, cold
    finally:
        kill_group(started.process, grace_s=5)
    # take() hands the zygote over; assign() refuses another interpreter and stops it
    pool.warm(key, launch.env)  # the failed start above made OMP_NUM_THREADS=2 the key's profile
    wait_for(lambda: ready_pids(pool, key), 60, "a ready zygote for the original profile")
    zygote = pool.take(key)
    other_python = ReplicaLaunch(argv=["/usr/bin/python3", *launch.argv[1:]], env=launch.env)
    with pytest.raises(AssignmentRefused, match="python /usr/bin/python3 is not the zygote's"):
        zygote.assign(other_python, tmp_path / "other.log")
    assert zygote.process.poll() is not None  # a refused zygote is not left behind


def test_a_zygote_killed_while_idle_is_replaced(pool, probe, tmp_path):
    launch = probe(tmp_path / "r.json")
    key = PoolKey.for_launch("probe", launch)
    pool.warm(key, launch.env)
    [first] = wait_for(lambda: ready_pids(pool, key), 60, "a ready zygote")
    os.kill(first, signal.SIGKILL)
    [second] = wait_for(lambda: [p for p in ready_pids(pool, key) if p != first], 60, "a replacement")
    assert gone(first) and second != first


def test_a_forgotten_key_loses_its_idle_zygotes_and_is_not_refilled(pool, probe, tmp_path):
    """The supervisor forgets a key when the image its interpreter ran from is unmounted."""
    launch = probe(tmp_path / "r.json")
    key = PoolKey.for_launch("probe", launch)
    pool.warm(key, launch.env)
    [zygote] = wait_for(lambda: ready_pids(pool, key), 60, "a ready zygote")
    pool.forget(key)
    assert gone(zygote)
    pool.reconcile()
    assert key not in pool.idle()


def test_close_leaves_no_process(probe, tmp_path):
    pool = WarmPool(WarmPoolConfig(size_per_kind=2, refill_delay_s=0.0, poll_interval_s=0.1,
                                   log_dir=tmp_path / "zygotes"), kinds={"probe": PROBE_KIND})
    launch = probe(tmp_path / "r.json")
    pool.warm(PoolKey.for_launch("probe", launch), launch.env)
    pids = wait_for(lambda: [p for ps in pool.idle().values() for p in ps if len(ps) == 2], 30, "two zygotes")
    pool.close()
    assert all(gone(pid) for pid in pids)
    assert pool.idle() == {}
    assert not list((tmp_path / "zygotes").iterdir())  # their output files too


def test_zygotes_exit_when_the_process_holding_the_pool_dies(probe, tmp_path):
    """A supervisor killed with SIGKILL cannot close its pool: each zygote sees its control socket close."""
    holder = subprocess.Popen([PYTHON, "-c", textwrap.dedent(f"""
        import sys, time
        from cluster.local.warm_pool import PoolKey, WarmPool, WarmPoolConfig
        from serving.runtime.zygote import ZygoteKind
        pool = WarmPool(WarmPoolConfig(refill_delay_s=0, poll_interval_s=0.1),
                        kinds={{"probe": ZygoteKind(serves=("{PROBE}",), preload=("json",))}})
        pool.warm(PoolKey("probe", sys.executable))
        while not pool.idle():
            time.sleep(0.1)
        print(pool.idle()[PoolKey("probe", sys.executable)][0], flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        zygote_pid = int(holder.stdout.readline())
        assert not gone(zygote_pid)
        holder.kill()
        holder.wait()
        wait_for(lambda: gone(zygote_pid), 30, "the orphaned zygote to exit")
    finally:
        holder.kill()


def test_the_refill_waits_for_the_clock(probe, tmp_path):
    clock = FakeClock(start_s=1000.0)
    pool = WarmPool(WarmPoolConfig(refill_delay_s=30.0, log_dir=tmp_path / "zygotes"), clock=clock,
                    background=False, kinds={"probe": PROBE_KIND})
    try:
        launch = probe(tmp_path / "r.json")
        started = pool.start("probe", launch, tmp_path / "r.log")
        kill_group(started.process, grace_s=5)
        assert pool.reconcile() == PoolPlan()  # a zygote's imports would slow the replica just started
        clock.advance(30.0)
        assert pool.reconcile().start == (PoolKey.for_launch("probe", launch),)
    finally:
        pool.close()


def test_a_one_off_replica_keeps_nothing_warm(probe, tmp_path):
    """The cost sweep's benchmark replica runs from the machine's environment; the replicas that
    serve run from their image's. Warming its key would hold a zygote (720 MiB for vLLM) for nothing."""
    clock = FakeClock(start_s=1000.0)
    pool = WarmPool(WarmPoolConfig(refill_delay_s=30.0, log_dir=tmp_path / "zygotes"), clock=clock,
                    background=False, kinds={"probe": PROBE_KIND})
    try:
        launch = probe(tmp_path / "r.json")
        started = pool.start("probe", launch, tmp_path / "r.log", keep_warm=False)
        assert not started.warm
        kill_group(started.process, grace_s=5)
        clock.advance(3600.0)
        assert pool.reconcile() == PoolPlan()
        kill_group(pool.start("probe", launch, tmp_path / "r2.log").process, grace_s=5)  # one that serves: warmed
        clock.advance(30.0)
        assert pool.reconcile().start == (PoolKey.for_launch("probe", launch),)
    finally:
        pool.close()


# ---- the pyfunc runtime: a warm replica answers as a cold one ---------------------------------

@pytest.fixture(scope="module")
def iris_dir(tmp_path_factory) -> Path:
    from mlflow import MlflowClient

    from demo.iris import log_iris
    from pipelines.registry import MlflowRegistry

    root = tmp_path_factory.mktemp("iris")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).create_experiment("modelplane-demo", artifact_location=(root / "artifacts").as_uri())
    log_iris(uri)
    return MlflowRegistry(uri).download("iris", "1", root / "model")


def serve_and_ask(process: subprocess.Popen, port: int, rows: dict, log_path: Path) -> tuple[int, dict]:
    base = f"http://127.0.0.1:{port}"

    def healthy():
        assert process.poll() is None, log_path.read_text()[-3000:]
        try:
            return httpx.get(f"{base}/health", timeout=2, trust_env=False, verify=tls_context()).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, 90, "the pyfunc replica to be healthy")
    answer = httpx.post(f"{base}/invocations", json=rows, timeout=30, trust_env=False)
    return answer.status_code, answer.json()


def test_a_warm_pyfunc_replica_answers_like_a_cold_one(iris_dir, tmp_path):
    from serving.runtime.pyfunc.runtime import PyfuncRuntime

    runtime, config = PyfuncRuntime(), RuntimeConfig(model_name="iris", cpu_cores=1)
    rows = {"dataframe_split": {"columns": ["sepal length (cm)", "sepal width (cm)", "petal length (cm)",
                                            "petal width (cm)"], "data": [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]}}
    answers = {}
    with WarmPool(WarmPoolConfig(refill_delay_s=0.0, poll_interval_s=0.1, log_dir=tmp_path / "zygotes")) as pool:
        for how in ("cold", "warm"):
            port = free_port()
            launch = runtime.command(iris_dir, "127.0.0.1", port, config)
            if how == "warm":
                wait_for(lambda: ready_pids(pool, PoolKey.for_launch("pyfunc", launch)), 60, "a pyfunc zygote")
            started = pool.start("pyfunc", launch, tmp_path / f"{how}.log")
            try:
                assert started.warm is (how == "warm"), started.reason
                answers[how] = serve_and_ask(started.process, port, rows, tmp_path / f"{how}.log")
            finally:
                kill_group(started.process, grace_s=5)
    assert answers["warm"] == answers["cold"]
    assert answers["warm"][0] == 200 and len(answers["warm"][1]["predictions"]) == 2
    assert "model loaded from" in (tmp_path / "warm.log").read_text()  # the server's own log lines


# ---- vLLM (slow): the tiny Llama on a warm zygote ---------------------------------------------

@pytest.mark.slow
def test_a_warm_vllm_replica_serves_and_stops_with_its_engine(tmp_path, tiny_llama):
    from mlflow import MlflowClient

    from demo.tiny_llama import log_tiny_llama
    from pipelines.registry import MlflowRegistry
    from serving.runtime.vllm_runtime import VllmRuntime

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).create_experiment("modelplane-demo", artifact_location=(tmp_path / "a").as_uri())
    log_tiny_llama(uri, tiny_llama(tmp_path / "tiny"), registered_model_name="tiny-llm")
    model_dir = MlflowRegistry(uri).download("tiny-llm", "1", tmp_path / "downloaded")
    port = free_port()
    launch = VllmRuntime().command(model_dir, "127.0.0.1", port, RuntimeConfig(model_name="tiny"))
    with WarmPool(WarmPoolConfig(refill_delay_s=3600.0, poll_interval_s=0.2, log_dir=tmp_path / "z")) as pool:
        key = PoolKey.for_launch("vllm", launch)
        pool.warm(key, launch.env)
        wait_for(lambda: ready_pids(pool, key), 120, "a vLLM zygote")
        started = pool.start("vllm", launch, tmp_path / "replica.log")
    assert started.warm, started.reason
    base, session = f"http://127.0.0.1:{port}", started.process.pid
    try:
        def healthy():
            assert started.process.poll() is None, (tmp_path / "replica.log").read_text()[-4000:]
            try:
                return httpx.get(f"{base}/health", timeout=2, trust_env=False, verify=tls_context()).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 240, "vLLM to be healthy", interval_s=0.5)
        answer = httpx.post(f"{base}/v1/completions", timeout=60, trust_env=False,
                            json={"model": "tiny", "prompt": "Fix: she go home.", "max_tokens": 4, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
        log_text = (tmp_path / "replica.log").read_text()
        assert f"modelplane-amx pid={session} " in log_text  # the API server ran the plugin, into the log
        engine = [p for p in psutil.process_iter() if _session_of(p) == session and p.pid != session]
        assert engine, "the engine core runs in the replica's session"
    finally:
        kill_group(started.process, grace_s=15)
    wait_for(lambda: not [p for p in psutil.process_iter() if _session_of(p) == session], 30,
             "every process of the replica's session to go")


def _session_of(process: psutil.Process) -> int | None:
    try:
        return None if process.status() == psutil.STATUS_ZOMBIE else os.getsid(process.pid)
    except (psutil.Error, ProcessLookupError):
        return None


# ---- the benchmark's judgement ---------------------------------------------------------------

def _summary(first_s: float, tokens_per_s: float, errors: int = 0) -> dict:
    def one(value):
        return {"min": value, "median": value, "max": value, "n": 1}
    return {"first_inference_s": one(first_s), "output_tokens_per_s": one(tokens_per_s), "errors": errors}


@pytest.mark.parametrize("ours, meets, reason", [
    (_summary(30.0, 98.0), True, ""),  # 0.75 of the anchor's time, 0.98 of its throughput
    (_summary(36.0, 100.0), False, "time ratio 0.9 > 0.8"),
    (_summary(30.0, 90.0), False, "throughput ratio 0.9 < 0.95"),
    (_summary(30.0, 100.0, errors=1), False, "1 failed requests"),
])
def test_the_startup_benchmark_judges_ours_against_the_cold_anchor(ours, meets, reason):
    from benchmarks.engine_startup import judge

    compared, ratio, got_meets, got_reason = judge({"anchor_cold": _summary(40.0, 100.0), "ours_warm": ours})
    assert (ratio, got_meets, got_reason) == (compared["ours_warm"]["time_to_first_inference_ratio"], meets, reason)
