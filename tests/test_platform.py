"""`modelplane up` for real: MLflow, Dagster, the admin API, the supervisor and the router.

One platform is started for the module. The tests check its health, refuse a second `up`,
follow models registered over MLflow's REST API through MLflow's own signed webhook to
Dagster deploy runs and on to answers through the router (the sklearn model on the pyfunc
runtime, the tiny Llama on vLLM), redeploy under load without a failed request, and finally
stop it all with SIGTERM and look for leftover processes.
"""

import contextlib
import signal
import threading
import time

import httpx
import psutil
import pytest

from benchmarks.reliability.platform import IRIS_REQUEST, REGISTER_IRIS, RunningPlatform
from benchmarks.polling import answers_ok
from controlplane.code_server import WORKER_LINE
from tests.conftest import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    running = RunningPlatform(tmp_path_factory.mktemp("platform") / "home")
    try:
        running.wait_up()
        yield running
    finally:
        running.close()


def test_up_prints_the_urls_and_every_service_answers(platform):
    log = platform.log()
    for name, service in [("MLflow UI", "mlflow"), ("Dagster UI", "dagster"), ("Admin API", "admin"),
                          ("Router", "router")]:
        assert f"{name}" in log and platform.url(service) in log
    assert httpx.get(f"{platform.url('mlflow')}/health").text.strip() == "OK"
    assert httpx.get(f"{platform.url('admin')}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{platform.url('dagster')}/server_info").status_code == 200
    assert httpx.get(f"{platform.url('router')}/healthz").json()["status"] == "ok"


def test_the_state_directory_is_readable_by_its_owner_only(platform):
    import stat

    assert stat.S_IMODE(platform.home.stat().st_mode) == 0o700
    shared = [path for path in platform.home.rglob("*")
              if path.is_file() and path.name != "up.out" and path.stat().st_mode & 0o077]  # up.out: this test's capture
    assert shared == [], [(str(p), oct(p.stat().st_mode)) for p in shared[:5]]
    assert (platform.home / "controlplane.db").is_file() and (platform.home / "secrets.json").is_file()


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


def register(platform, code: str) -> None:
    platform.register(code)


def runs(platform, partition: str) -> list[dict]:
    return platform.runs(partition)


def finished_run(platform, partition: str, timeout_s: float) -> dict:
    return platform.finished_run(partition, timeout_s)


def token(platform, *endpoints: str) -> str:
    value = platform.token(*endpoints)
    CREATED_TOKENS.append(value)  # no log may show it (test_no_log_holds_a_token_or_a_secret)
    return value


CREATED_TOKENS: list[str] = []


def test_a_registered_version_is_deployed_and_answers_through_the_router(platform):
    created = platform.cli("endpoints", "create", "-f", "examples/endpoints/iris.yaml")
    assert created.returncode == 0, created.stderr
    register(platform, REGISTER_IRIS)  # through the MLflow server, as a data scientist would

    run = finished_run(platform, "iris.v1", 300)
    assert run["status"] == "SUCCESS"
    assert len(runs(platform, "iris.v1")) == 1
    # MLflow signed the deliveries with the secret `up` gave it, and the admin API accepted them.
    import sqlite3

    with sqlite3.connect(platform.home / "controlplane.db") as connection:
        events = {row[0] for row in connection.execute("SELECT event FROM webhook_inbox WHERE registered_model='iris'")}
    assert events == {"model_version.created", "model_version_alias.created"}
    assert (platform.home / "models" / "iris" / "v1" / "source" / "MLmodel").exists()

    answer = httpx.post(f"{platform.url('router')}/serving-endpoints/iris/invocations", json=IRIS_REQUEST,
                        headers={"Authorization": f"Bearer {token(platform, 'iris')}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"predictions": [0]}


def test_the_tiny_llm_answers_the_openai_client_through_the_router(platform, tmp_path, tiny_llama):
    from openai import OpenAI

    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: tiny-llm\nmodel: models:/tiny-llm@champion\nscaling: {min_replicas: 1, max_replicas: 1}\n"
                    "cost_model: {input_tokens: [16, 64], output_tokens: [4, 16], concurrency: [1, 4], max_point_s: 5}\n")
    assert platform.cli("endpoints", "create", "-f", str(spec)).returncode == 0
    checkpoint = tiny_llama(tmp_path / "tiny")  # demo.tiny_llama's build, made once for the run
    register(platform, f"import sys, pathlib; from demo.tiny_llama import log_tiny_llama;"
                       f"v = log_tiny_llama(sys.argv[1], pathlib.Path({str(checkpoint)!r}));"
                       "from mlflow import MlflowClient; MlflowClient(sys.argv[1], sys.argv[1])"
                       ".set_registered_model_alias('tiny-llm', 'champion', v.version)")
    # quantization, the eval gate, the cost sweep and the first build of the vLLM environment layer
    assert finished_run(platform, "tiny-llm.v1", 1500)["status"] == "SUCCESS"

    client = OpenAI(base_url=f"{platform.url('router')}/v1", api_key=token(platform, "tiny-llm"))
    completion = client.completions.create(model="tiny-llm", prompt="She go to", max_tokens=5, temperature=0)
    assert completion.choices[0].text
    chat = client.chat.completions.create(model="tiny-llm", messages=[{"role": "user", "content": "Fix: she go."}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].message.content is not None
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny-llm", messages=[{"role": "user", "content": "Fix: she go."}], max_tokens=5, stream=True)
        if c.choices]
    assert len(pieces) >= 2
    assert [m.id for m in client.models.list().data] == ["tiny-llm"]
    # the cost sweep's replica ran from this machine's environment; the replica that serves, from the
    # image's: only the image's is kept warm (controlplane.revisions.ONE_OFF)
    supervisor_log = (platform.home / "logs" / "supervisor.log").read_text()
    warmed = [line for line in supervisor_log.splitlines() if "started vllm zygote" in line]
    assert all("/images/runtime/mnt/" in line for line in warmed), warmed


@contextlib.contextmanager
def steady_iris_requests(platform, pause_s: float = 0.02):
    """Yield the list of status codes of a request loop through the router, running meanwhile."""
    headers = {"Authorization": f"Bearer {token(platform, 'iris')}"}
    url = f"{platform.url('router')}/serving-endpoints/iris/invocations"
    statuses: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                statuses.append(client.post(url, json=IRIS_REQUEST, headers=headers).status_code)
                time.sleep(pause_s)

    sender = threading.Thread(target=loop)
    sender.start()
    try:
        yield statuses
    finally:
        stop.set()
        sender.join()


def test_redeploying_under_a_steady_request_loop_fails_no_request(platform):
    with steady_iris_requests(platform) as statuses:
        register(platform, REGISTER_IRIS)
        assert finished_run(platform, "iris.v2", 300)["status"] == "SUCCESS"
        time.sleep(2)
    assert len(statuses) > 50
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}


def test_moving_the_alias_back_serves_the_old_version_again_without_rebuilding_it(platform):
    """The usual MLflow rollback: the endpoint converges to what the alias names, and only rolls out."""
    register(platform, "import sys; from mlflow import MlflowClient; MlflowClient(sys.argv[1], sys.argv[1])"
                       ".set_registered_model_alias('iris', 'champion', '1')")
    rollback = wait_for(lambda: [r for r in runs(platform, "iris.v1") if r["status"] in ("SUCCESS", "FAILURE")
                                 and {t["key"]: t["value"] for t in r["tags"]}.get("modelplane/reuse") == "true"],
                        300, "the rollback run")[0]
    assert rollback["status"] == "SUCCESS"
    status = wait_for(lambda: (lambda out: out if "(iris.v1)" in out else None)(
        platform.cli("endpoints", "status", "iris").stdout), 60, "iris serving v1 again")
    assert "serving revision iris-v1-" in status
    answer = httpx.post(f"{platform.url('router')}/serving-endpoints/iris/invocations", json=IRIS_REQUEST,
                        headers={"Authorization": f"Bearer {token(platform, 'iris')}"}, timeout=30)
    assert answer.status_code == 200, answer.text


def test_status_shows_each_endpoint_its_revision_replicas_and_traffic_on_the_running_platform(platform):
    import json

    from controlplane.status_view import ENDPOINT_HEADERS

    answered = httpx.post(f"{platform.url('router')}/serving-endpoints/iris/invocations", json=IRIS_REQUEST,
                          headers={"Authorization": f"Bearer {token(platform, 'iris')}"}, timeout=30)
    assert answered.status_code == 200
    shown = platform.cli("status", "--json")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    endpoints = {e["name"]: e for e in data["endpoints"]}
    assert {"iris", "tiny-llm"} <= set(endpoints) and data["routers"]["live"] >= 1
    iris = endpoints["iris"]
    assert iris["serving_revision"].startswith("iris-v1-")  # the alias was moved back to v1
    assert iris["ready_replicas"] == iris["desired_replicas"] >= 1
    platform.env["COLUMNS"] = "250"  # rich wraps its table at the terminal's width
    table = platform.cli("status").stdout
    assert "Endpoints" in table and "Revisions" in table
    assert all(header in table for header in ENDPOINT_HEADERS)
    assert any(line.split("│")[1].strip() == "iris" for line in table.splitlines() if line.count("│") > 2), table


def test_one_dagster_code_server_serves_the_webserver_the_daemon_and_every_run(platform):
    """After minutes of deploys: the code server `up` started is the only one, and it was not
    replaced (the daemon replaces code servers of its own every 60 s, importing the code again),
    and each run's worker inherited the code location's imports from its forkserver."""
    servers = [p for p in platform.processes()
               if "api grpc" in " ".join(p.cmdline()) or "controlplane.code_server" in p.cmdline()]
    assert [s.ppid() for s in servers] == [platform.process.pid], [" ".join(s.cmdline()) for s in servers]
    assert time.time() - servers[0].create_time() > 120  # the deploy tests above took longer than that
    workers = [line for line in (platform.home / "logs" / "dagster-code-server.log").read_text().splitlines()
               if WORKER_LINE in line]
    assert len(workers) >= 3 and all("already imported" in line for line in workers), workers
    workspace = (platform.home / "dagster" / "workspace.yaml").read_text()
    assert "grpc_server" in workspace and str(platform.home / "dagster" / "code-server.sock") in workspace


def platform_processes(platform) -> list[psutil.Process]:
    return platform.processes()


def test_every_listening_socket_of_the_platform_is_on_loopback(platform):
    """After the deploys: MLflow, Dagster, the admin API, the registry, the router, the supervisor's
    replicas (pyfunc and vLLM, with its engine processes), the warm pool and the mount daemons."""
    listening = []
    for process in platform_processes(platform):
        with contextlib.suppress(psutil.Error):
            for connection in process.net_connections(kind="inet"):
                if connection.status == psutil.CONN_LISTEN:
                    listening.append((process.pid, " ".join(process.cmdline())[:120], connection.laddr))
    assert len({pid for pid, _, _ in listening}) >= 5, listening  # the services, at least
    exposed = [(pid, cmd, f"{address.ip}:{address.port}") for pid, cmd, address in listening
               if address.ip not in ("127.0.0.1", "::1")]
    assert exposed == [], exposed


def test_no_log_holds_a_token_or_a_secret(platform):
    """Every file the platform wrote but its stores and secrets file: no bearer token the tests
    created, no webhook secret, no encryption key."""
    import json

    secrets = json.loads((platform.home / "secrets.json").read_text())
    needles = [*CREATED_TOKENS, *(v for v in secrets.values() if isinstance(v, str) and len(v) >= 16)]
    assert CREATED_TOKENS and len(needles) > len(CREATED_TOKENS)
    skipped_dirs = {"images", "models", "registry", "artifacts"}  # binary content: layers, weights, blobs
    checked, leaks = 0, []
    for path in platform.home.rglob("*"):
        if (not path.is_file() or path.name == "secrets.json" or ".db" in path.name
                or skipped_dirs & set(path.relative_to(platform.home).parts) or path.stat().st_size > 64 << 20):
            continue
        text = path.read_bytes().decode("utf-8", "replace")
        checked += 1
        leaks += [(str(path), needle[:6] + "…") for needle in needles if needle in text]
    assert checked >= 10 and leaks == [], leaks


def service_process(platform, module: str) -> psutil.Process | None:
    return platform.service_process(module)


def pyfunc_pids(platform) -> set[int]:
    """This platform's pyfunc replicas' processes (not the warm pool's idle zygotes, which go with
    their supervisor; not another test's replicas, which may run beside it)."""
    pids = set()
    for process in platform_processes(platform):
        try:
            cmdline = " ".join(process.cmdline())
            if "serving.runtime.pyfunc" in cmdline and "serving.runtime.zygote" not in cmdline:
                pids.add(process.pid)
        except psutil.Error:
            continue
    return pids


def test_a_service_that_dies_is_restarted_while_the_endpoints_keep_serving(platform):
    """SIGKILL the admin API, the replica supervisor and the autoscaler: `up` restarts them; the router
    never stops answering, the new supervisor adopts the running iris replica instead of restarting
    it, and the new autoscaler takes the lease over (with no history, it scales nothing down)."""
    replica_pids = pyfunc_pids(platform)
    desired_before = iris_desired_replicas(platform)
    with steady_iris_requests(platform, pause_s=0.05) as statuses:
        for module in ("controlplane.admin_api", "cluster.local.supervisor", "autoscale.controller"):
            old = service_process(platform, module)
            old.kill()
            wait_for(lambda: getattr(service_process(platform, module), "pid", old.pid) != old.pid, 60,
                     f"{module} restarted")
        wait_for(lambda: answers_ok(f"{platform.url('admin')}/healthz"), 60, "the admin API back")
        time.sleep(5)  # the new supervisor has looked at its replicas a few times
    assert platform.process.poll() is None and "restarted it" in platform.log()
    assert len(statuses) > 20 and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    assert replica_pids and replica_pids <= pyfunc_pids(platform)  # adopted, not restarted
    autoscaler = service_process(platform, "autoscale.controller")
    wait_for(lambda: autoscaler_lease_holder(platform).endswith(f":{autoscaler.pid}"), 30, "the new autoscaler's lease")
    assert iris_desired_replicas(platform) >= desired_before


def autoscaler_lease_holder(platform) -> str:
    from controlplane.db import make_engine
    from controlplane.scaling import AUTOSCALER_LEASE, Lease

    engine = make_engine(f"sqlite:///{platform.home / 'controlplane.db'}")
    try:
        held = Lease(engine, AUTOSCALER_LEASE, "test", ttl_s=10).holder_now()
        return held[0] if held else ""
    finally:
        engine.dispose()


def iris_desired_replicas(platform) -> int:
    from controlplane.db import make_engine
    from controlplane.revisions import RevisionStore

    engine = make_engine(f"sqlite:///{platform.home / 'controlplane.db'}")
    try:
        revisions = RevisionStore(engine)
        return revisions.get(revisions.traffic()["iris"]).desired_replicas
    finally:
        engine.dispose()


def test_sigterm_stops_every_process_it_started(platform):
    parent = psutil.Process(platform.process.pid)
    descendants = parent.children(recursive=True)
    assert len(descendants) >= 6
    platform.process.send_signal(signal.SIGTERM)
    assert platform.process.wait(timeout=90) == 0
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert alive == [], [p.info for p in alive]
    for port in platform.ports.values():
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)


def test_sigterm_while_starting_stops_what_had_started(tmp_path):
    starting = RunningPlatform(tmp_path / "home")
    wait_for(lambda: "is up" in starting.log() or starting.process.poll() is not None, 120, "the first service")
    descendants = psutil.Process(starting.process.pid).children(recursive=True)
    assert descendants, starting.log()
    starting.process.send_signal(signal.SIGTERM)
    assert starting.process.wait(timeout=90) != 0  # interrupted, not a clean run
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert alive == []
