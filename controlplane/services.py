"""The services ``modelplane up`` runs, each with its command line and health check, built from
:class:`~controlplane.settings.Settings`: the OCI registry, MLflow, the admin API, Dagster's
code server, webserver and daemon, the supervisor, the routers, the autoscaler and, with ``--prometheus``,
Prometheus and its targets writer. :class:`controlplane.platform.Platform` starts and watches them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from controlplane.code_server import CODE_LOCATION_MODULE
from controlplane.settings import OFFLINE_ENV, REPO_ROOT, Secrets, Settings
from serving.tls import tls_context

BIN = Path(sys.executable).parent
CODE_LOCATION = "modelplane"  # the code location's name, as workspace.yaml names it for `dagster dev`


@dataclass
class Service:
    name: str
    argv: list[str]
    healthy: Callable[[], bool]
    url: str | None = None
    port: int | None = None
    after: str | None = None  # started once the service of this name is healthy (its clients need it)
    process: subprocess.Popen | None = field(default=None, repr=False)


def _http_ok(url: str, expect: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return expect(httpx.get(url, timeout=2.0, verify=tls_context()))
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


def _socket_accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def _all_of(*checks: Callable[[], bool]) -> Callable[[], bool]:
    return lambda: all(check() for check in checks)


def dagster_workspace(settings: Settings) -> str:
    """The workspace ``up`` writes for its webserver and daemon: the one code location, served by
    the code server it runs. Both connect to it instead of starting code servers of their own,
    which the daemon would replace every 60 s (``RELOAD_WORKSPACE_INTERVAL`` in Dagster's daemon
    controller), importing the whole code location again each time."""
    return ("# Written by `modelplane up`: the code location is served by the code server it runs\n"
            "# (the dagster-code-server service, logs/dagster-code-server.log).\n"
            "load_from:\n"
            "  - grpc_server:\n"
            f"      socket: {json.dumps(str(settings.dagster_code_socket))}\n"  # quoted: any path is valid YAML
            f"      location_name: {CODE_LOCATION}\n")


def _dagster_daemon_healthy(dagster_url: str) -> Callable[[], bool]:
    query = "{ instance { daemonHealth { allDaemonStatuses { daemonType healthy required } } } }"

    def check() -> bool:
        try:
            response = httpx.post(f"{dagster_url}/graphql", json={"query": query}, timeout=5.0, verify=tls_context())
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
        dagster_code_server(settings),
        Service(
            name="dagster-webserver",
            argv=[str(BIN / "dagster-webserver"), "-h", host, "-p", str(ports.dagster_port),
                  "-w", str(settings.dagster_workspace), "--log-level", "warning"],
            healthy=_http_ok(f"{settings.dagster_url}/server_info"),
            url=settings.dagster_url,
            port=ports.dagster_port,
            after="dagster-code-server",
        ),
        Service(
            name="dagster-daemon",
            argv=[str(BIN / "dagster-daemon"), "run", "-w", str(settings.dagster_workspace), "--log-level", "warning"],
            healthy=_dagster_daemon_healthy(settings.dagster_url),
            after="dagster-code-server",
        ),
        *prometheus_services(settings),
    ]


def dagster_code_server(settings: Settings) -> Service:
    """The code location (``pipelines.definitions``) in one long-lived gRPC server on a Unix
    socket, which the webserver and the daemon share (:func:`dagster_workspace`); Dagster runs
    launched through it start their run workers from it, forked from a process that has the code
    location imported (:mod:`controlplane.code_server`)."""
    sock = settings.dagster_code_socket
    log = settings.logs_dir / "dagster-code-server.log"
    return Service(name="dagster-code-server",
                   argv=[sys.executable, "-m", "controlplane.code_server", "--socket", str(sock),
                         "-m", CODE_LOCATION_MODULE, "-d", str(REPO_ROOT), "--location-name", CODE_LOCATION,
                         "--log-level", "info"],
                   healthy=_all_of(_log_says(log, "Started Dagster code server"), lambda: _socket_accepts(sock)))


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
