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
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from controlplane import db
from controlplane.backoff import restart_delay_s
from controlplane.services import Service, build_services, child_environment, dagster_workspace, port_in_use
from controlplane.settings import REPO_ROOT, Settings
from controlplane.webhooks import EVENTS

WEBHOOK_NAME = "modelplane-registry"


class PlatformError(Exception):
    """Something a person must fix before the platform can start; the message says what."""


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
            settings.dagster_workspace.write_text(dagster_workspace(settings))
            for service in self.services:
                if service.after is None:
                    self._spawn(service, env)
            for service in self.services:  # a service comes after the one it waits for
                self._wait_healthy(service)
                self._log(f"{service.name} is up" + (f" at {service.url}" if service.url else ""))
                for waiting in self.services:
                    if waiting.after == service.name:
                        self._spawn(waiting, env)
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
