"""``modelplane up``: start MLflow, the admin API and Dagster on 127.0.0.1, and stop them.

:class:`Platform` is a context manager. Entering it takes the installation's lock (so a
second ``up`` says so instead of failing on a busy port), checks the ports, migrates the
control-plane database, starts every service in its own process group with its log under
``$MODELPLANE_HOME/logs``, waits for each health check, and registers the MLflow webhook.
Leaving it stops every process it started, and every process those started.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from controlplane import db
from controlplane.backoff import restart_delay_s
from controlplane.settings import OFFLINE_ENV, REPO_ROOT, Secrets, Settings
from controlplane.webhooks import EVENTS

WEBHOOK_NAME = "modelplane-registry"
BIN = Path(sys.executable).parent


class PlatformError(Exception):
    """Something a person must fix before the platform can start; the message says what."""


@dataclass
class Service:
    name: str
    argv: list[str]
    healthy: Callable[[], bool]
    url: str | None = None
    port: int | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)


def _http_ok(url: str, expect: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return expect(httpx.get(url, timeout=2.0))
        except httpx.HTTPError:
            return False

    return check


def _log_says(path: Path, marker: str) -> Callable[[], bool]:
    """Healthy once the service has written ``marker`` to its log (after this start)."""
    offset = path.stat().st_size if path.exists() else 0

    def check() -> bool:
        try:
            with path.open("rb") as f:
                f.seek(offset)
                return marker.encode() in f.read()
        except FileNotFoundError:
            return False

    return check


def _dagster_daemon_healthy(dagster_url: str) -> Callable[[], bool]:
    query = "{ instance { daemonHealth { allDaemonStatuses { daemonType healthy required } } } }"

    def check() -> bool:
        try:
            response = httpx.post(f"{dagster_url}/graphql", json={"query": query}, timeout=5.0)
            statuses = response.json()["data"]["instance"]["daemonHealth"]["allDaemonStatuses"]
        except (httpx.HTTPError, KeyError, TypeError, ValueError):
            return False
        sensor = [s for s in statuses if s["daemonType"] == "SENSOR"]
        return bool(sensor) and all(s["healthy"] for s in statuses if s["required"])

    return check


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def child_environment(settings: Settings, secrets: Secrets) -> dict[str, str]:
    """What every service inherits: where the state is, and MLflow's webhook settings."""
    return {
        **os.environ,
        **OFFLINE_ENV,
        "MODELPLANE_HOME": str(settings.home),
        "MODELPLANE_DATABASE_URL": settings.database_url,
        "MODELPLANE_MLFLOW_PORT": str(settings.ports.mlflow_port),
        "MODELPLANE_DAGSTER_PORT": str(settings.ports.dagster_port),
        "MODELPLANE_ADMIN_PORT": str(settings.ports.admin_port),
        "MODELPLANE_ROUTER_PORT": str(settings.ports.router_port),
        "MODELPLANE_REGISTRY_PORT": str(settings.ports.registry_port),
        "MLFLOW_TRACKING_URI": settings.mlflow_url,
        "DAGSTER_HOME": str(settings.dagster_home),
        "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": secrets.mlflow_webhook_encryption_key,
        "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
        "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
        # MLflow's server-side job runner (GenAI jobs) is unused here and costs ~7 processes.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        # A sensor tick must not hang for minutes on an unreachable MLflow: retry briefly,
        # then skip the tick (the next one comes 5 s later).
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
        "PYTHONUNBUFFERED": "1",
    }


def registry_services(settings: Settings) -> list[Service]:
    """The embedded OCI registry (Debian's docker-registry with a config of ours, on
    127.0.0.1), unless images are off or ``MODELPLANE_REGISTRY_URL`` names another registry."""
    if settings.images == "off" or settings.registry_url_override:
        return []
    return [Service(name="registry", argv=[sys.executable, "-m", "images.oci.server", "--root", str(settings.registry_dir),
                                           "--host", settings.host, "--port", str(settings.ports.registry_port)],
                    healthy=_http_ok(f"{settings.registry_url}/v2/"), url=settings.registry_url,
                    port=settings.ports.registry_port)]


def build_services(settings: Settings) -> list[Service]:
    host, ports = settings.host, settings.ports
    return [
        *registry_services(settings),
        Service(
            name="mlflow",
            argv=[str(BIN / "mlflow"), "server", "--backend-store-uri", settings.mlflow_backend_uri,
                  "--artifacts-destination", str(settings.mlflow_artifacts_dir),
                  "--host", host, "--port", str(ports.mlflow_port), "--workers", "1"],
            healthy=_http_ok(f"{settings.mlflow_url}/health"),
            url=settings.mlflow_url,
            port=ports.mlflow_port,
        ),
        Service(
            name="admin-api",
            argv=[sys.executable, "-m", "controlplane.admin_api"],
            healthy=_http_ok(f"{settings.admin_url}/healthz"),
            url=settings.admin_url,
            port=ports.admin_port,
        ),
        *supervisor_services(settings),
        *router_services(settings),
        Service(
            name="autoscaler",
            argv=[sys.executable, "-m", "autoscale.controller"],
            healthy=_log_says(settings.logs_dir / "autoscaler.log", "autoscaler running"),
        ),
        Service(
            name="dagster-webserver",
            argv=[str(BIN / "dagster-webserver"), "-h", host, "-p", str(ports.dagster_port),
                  "-w", str(REPO_ROOT / "workspace.yaml"), "--log-level", "warning"],
            healthy=_http_ok(f"{settings.dagster_url}/server_info"),
            url=settings.dagster_url,
            port=ports.dagster_port,
        ),
        Service(
            name="dagster-daemon",
            argv=[str(BIN / "dagster-daemon"), "run", "-w", str(REPO_ROOT / "workspace.yaml"), "--log-level", "warning"],
            healthy=_dagster_daemon_healthy(settings.dagster_url),
        ),
        *prometheus_services(settings),
    ]


def supervisor_services(settings: Settings) -> list[Service]:
    """The local backend's process supervisor; none when Kubernetes runs the replicas."""
    if settings.cluster != "local":
        return []
    return [Service(name="supervisor", argv=[sys.executable, "-m", "cluster.local.supervisor"],
                    healthy=_log_says(settings.logs_dir / "supervisor.log", "supervisor running"))]


def prometheus_services(settings: Settings) -> list[Service]:
    """With ``up --prometheus``: the targets writer (which also serves the control plane's
    metrics), then Debian's Prometheus on 127.0.0.1 (docs/metrics.md)."""
    if not settings.prometheus:
        return []
    return [
        Service(name="prometheus-targets", argv=[sys.executable, "-m", "controlplane.prometheus_targets"],
                healthy=_log_says(settings.logs_dir / "prometheus-targets.log", "prometheus targets running")),
        Service(name="prometheus", argv=[sys.executable, "-m", "controlplane.prometheus",
                                         "--port", str(settings.ports.prometheus_port)],
                healthy=_http_ok(f"{settings.prometheus_url}/-/ready"), url=settings.prometheus_url,
                port=settings.ports.prometheus_port),
    ]


def router_services(settings: Settings) -> list[Service]:
    """``settings.routers`` router processes on the one router port (SO_REUSEPORT): the first
    is checked through the port, each other by its log line "router listening"."""
    local_url = f"http://{settings.host}:{settings.ports.router_port}"  # MODELPLANE_ROUTER_URL may name a balancer
    services = [Service(name="router", argv=[sys.executable, "-m", "serving.router.server"],
                        healthy=_http_ok(f"{local_url}/healthz"), url=local_url, port=settings.ports.router_port)]
    for number in range(2, settings.routers + 1):
        name = f"router-{number}"
        services.append(Service(name=name, argv=[sys.executable, "-m", "serving.router.server"],
                                healthy=_log_says(settings.logs_dir / f"{name}.log", "router listening")))
    return services


class Platform:
    def __init__(self, settings: Settings, *, log: Callable[[str], None] = print, start_timeout_s: float = 300.0,
                 stop_requested: Callable[[], bool] = lambda: False) -> None:
        self._stop_requested = stop_requested  # checked while starting: a lost KeyboardInterrupt still stops
        self._env: dict[str, str] = {}
        self._restarts: dict[str, list[float]] = {}  # service name → when it was restarted
        self._due: dict[str, float] = {}  # service name → when its next restart is due
        self.settings = settings
        self.services = build_services(settings)
        self._log = log
        self._start_timeout_s = start_timeout_s
        self._lock_file = None

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> "Platform":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        settings = self.settings
        os.umask(0o077)  # every file `up` and its services create is their owner's alone
        settings.ensure_dirs()
        self._acquire_lock()
        try:
            busy = [s for s in self.services if s.port and port_in_use(settings.host, s.port)]
            if busy:
                names = ", ".join(f"{s.port} ({s.name})" for s in busy)
                raise PlatformError(
                    f"port {names} already in use by another program; choose others with --mlflow-port, "
                    "--dagster-port, --admin-port, --router-port or MODELPLANE_*_PORT"
                )
            db.upgrade(settings.database_url)
            shutil.copyfile(REPO_ROOT / "dagster.yaml", settings.dagster_home / "dagster.yaml")
            init_dagster_storage(settings.dagster_home)
            secrets = settings.secrets()
            env = child_environment(settings, secrets)
            self._env = env
            for service in self.services:
                self._spawn(service, env)
            for service in self.services:
                self._wait_healthy(service)
                self._log(f"{service.name} is up" + (f" at {service.url}" if service.url else ""))
            if self._stop_requested():
                raise KeyboardInterrupt("stop requested while starting")
            register_webhook(settings, secrets.webhook_secret)
            self._log(f"MLflow webhook '{WEBHOOK_NAME}' → {settings.admin_url}/webhooks/mlflow")
            self._write_lock_info()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        started = [s for s in self.services if s.process is not None]
        descendants: list[psutil.Process] = []
        for service in reversed(started):
            try:
                descendants += psutil.Process(service.process.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            _signal_group(service.process, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for service in started:
            try:
                service.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(service.process, signal.SIGKILL)
                service.process.wait()
            service.process = None
        # a supervisor killed before it unmounted leaves its image mounts (their daemons have
        # sessions of their own): take them down, and their daemons exit by themselves
        from images.mounts import sweep_leftovers

        for line in sweep_leftovers(self.settings.images_dir / "runtime"):
            self._log(f"took down {line.removeprefix('unmounted ').removeprefix('detached ')} left by the supervisor")
        _, alive = psutil.wait_procs(descendants, timeout=5)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        self._release_lock()

    def dead_services(self) -> list[Service]:
        return [s for s in self.services if s.process is not None and s.process.poll() is not None]

    def revive(self, now_s: float) -> list[str]:
        """Restart services that died, each after a backoff (1, 2, 4 … 30 s), while the others
        (the router, the supervisor's replicas) keep serving. Returns what it did, one line each.

        Raises :class:`PlatformError` for a service that died ``MAX_RESTARTS`` times within
        ``RESTART_WINDOW_S``: something is wrong that a restart does not mend.
        """
        done = []
        for service in self.dead_services():
            history = [t for t in self._restarts.get(service.name, []) if now_s - t < RESTART_WINDOW_S]
            if len(history) >= MAX_RESTARTS:
                raise PlatformError(f"{service.name} died {len(history)} times in {RESTART_WINDOW_S:.0f} s "
                                    f"(last exit {service.process.returncode}); see "
                                    f"{self.settings.logs_dir / (service.name + '.log')}")
            due = self._due.setdefault(service.name, now_s + restart_delay_s(len(history) + 1, 1.0, 30.0))
            if now_s < due:
                continue
            code = service.process.returncode
            self._spawn(service, self._env)
            self._restarts[service.name] = [*history, now_s]
            del self._due[service.name]
            done.append(f"{service.name} exited with code {code}; restarted it (restart {len(history) + 1})")
        return done

    def urls(self) -> dict[str, str]:
        urls = {"Router": self.settings.router_url, "MLflow UI": self.settings.mlflow_url,
                "Dagster UI": self.settings.dagster_url, "Admin API": self.settings.admin_url}
        if self.settings.prometheus:
            urls["Prometheus"] = self.settings.prometheus_url
        return urls

    # -- internals ----------------------------------------------------------------------
    def _spawn(self, service: Service, env: dict[str, str]) -> None:
        log_path = self.settings.logs_dir / f"{service.name}.log"
        with log_path.open("ab") as log_file:
            service.process = subprocess.Popen(
                service.argv, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )

    def _wait_healthy(self, service: Service) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._stop_requested():
                raise KeyboardInterrupt("stop requested while starting")
            if service.process.poll() is not None:
                raise PlatformError(
                    f"{service.name} exited with code {service.process.returncode} while starting; "
                    f"see {self.settings.logs_dir / (service.name + '.log')}"
                )
            if service.healthy():
                return
            time.sleep(0.5)
        raise PlatformError(
            f"{service.name} did not become healthy within {self._start_timeout_s:.0f} s; "
            f"see {self.settings.logs_dir / (service.name + '.log')}"
        )

    @property
    def _lock_path(self) -> Path:
        return self.settings.home / "up.lock"

    def _acquire_lock(self) -> None:
        lock_file = self._lock_path.open("a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            info = lock_file.read().strip()
            lock_file.close()
            detail = ""
            if info:
                data = json.loads(info)
                detail = f" (pid {data['pid']}; Dagster UI {data['urls']['Dagster UI']})"
            raise PlatformError(f"modelplane is already running for {self.settings.home}{detail}") from None
        self._lock_file = lock_file

    def _write_lock_info(self) -> None:
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(json.dumps({"pid": os.getpid(), "urls": self.urls()}))
        self._lock_file.flush()

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.seek(0)
            self._lock_file.truncate()
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None


MAX_RESTARTS = 5  # a service dying this often within RESTART_WINDOW_S stops `up`
RESTART_WINDOW_S = 600.0


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def init_dagster_storage(dagster_home: Path) -> None:
    """Create Dagster's SQLite storage before its webserver and daemon start.

    On a fresh DAGSTER_HOME both would create (and Alembic-stamp) the same databases at
    once, and one of them dies with ``UNIQUE constraint failed: alembic_version``.
    """
    from dagster import DagsterInstance

    os.environ["DAGSTER_HOME"] = str(dagster_home)  # dagster.yaml reads its storage dir from it
    instance = DagsterInstance.from_config(str(dagster_home))
    try:
        instance.get_runs(limit=1)
        instance.event_log_storage.get_asset_records()
        instance.schedule_storage.all_instigator_state()
    finally:
        instance.dispose()


def register_webhook(settings: Settings, secret: str) -> None:
    """Point MLflow's registry webhook at this admin API (create it, or update it in place)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=settings.mlflow_url, registry_uri=settings.mlflow_url)
    url = f"{settings.admin_url}/webhooks/mlflow"
    existing = [w for w in client.list_webhooks(max_results=1000) if w.name == WEBHOOK_NAME]
    if existing:
        client.update_webhook(existing[0].webhook_id, url=url, events=list(EVENTS), secret=secret, status="ACTIVE")
        for duplicate in existing[1:]:
            client.delete_webhook(duplicate.webhook_id)
    else:
        client.create_webhook(name=WEBHOOK_NAME, url=url, events=list(EVENTS), secret=secret,
                              description="modelplane: deploy new versions behind watched aliases")
