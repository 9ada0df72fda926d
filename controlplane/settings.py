"""Where modelplane keeps its state and which ports it serves on.

One typed object, built once per process from the environment. Every path lives under
``MODELPLANE_HOME`` (default ``.modelplane/`` in the checkout):

    .modelplane/
      controlplane.db        control-plane database (SQLite, WAL) unless MODELPLANE_DATABASE_URL
      mlflow/mlflow.db       MLflow backend store
      mlflow/artifacts/      MLflow artifact store
      dagster/               DAGSTER_HOME (dagster.yaml copied here, the workspace up writes, run and event storage)
      models/                model versions: <model>/v<N>/source (source_model), quantized, eval/
      logs/                  one log file per service started by ``modelplane up``
      secrets.json           webhook secret and MLflow's webhook encryption key (mode 0600)
      prometheus/            with ``up --prometheus``: its config, rules, scrape targets and data
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from pathlib import Path

from pydantic import BaseModel, Field, field_validator, model_validator

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Given to every process modelplane starts: no usage telemetry leaves a self-hosted install.
OFFLINE_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
#: ``Settings.liveness_<name>``, from ``MODELPLANE_LIVENESS_<NAME>``: the fields of ``LivenessConfig``.
LIVENESS_SETTINGS = ("hang_after_s", "idle_probe_after_s", "probe_timeout_s", "unanswered_after_s")


class Ports(BaseModel):
    """TCP ports on 127.0.0.1 for the services ``modelplane up`` starts."""

    mlflow_port: int = Field(5000, ge=1, le=65535, description="MLflow tracking server")
    dagster_port: int = Field(3000, ge=1, le=65535, description="Dagster webserver (UI)")
    admin_port: int = Field(8100, ge=1, le=65535, description="modelplane admin API")
    router_port: int = Field(8080, ge=1, le=65535, description="the router: every endpoint's front door")
    registry_port: int = Field(5050, ge=1, le=65535, description="the embedded OCI registry (serving images)")
    prometheus_port: int = Field(9090, ge=1, le=65535, description="Prometheus (`up --prometheus`), on 127.0.0.1 only")


class Settings(BaseModel):
    """Paths, URLs and ports of one modelplane installation."""

    home: Path
    database_url: str
    ports: Ports = Ports()
    host: str = "127.0.0.1"
    mlflow_tracking_uri_override: str | None = None
    quantize_python: Path = REPO_ROOT / ".venv-quantize" / "bin" / "python"
    routers: int = Field(1, ge=1, le=64, description="Router processes sharing the router port (SO_REUSEPORT).")
    amx: str = "auto"  # MODELPLANE_AMX: "auto" or "off" (serving/runtime/amx.py); replicas read it from the env
    # Serving images (images/): "lazy" builds one per served version and starts replicas from its
    # lazily fetched, mounted seekable form where this machine can mount it; "off" builds none and
    # starts replicas from the model directory and this venv in place.
    images: str = Field("lazy", pattern="^(lazy|off)$", description="MODELPLANE_IMAGES: lazy | off")
    registry_url_override: str | None = None  # MODELPLANE_REGISTRY_URL: an OCI registry of your own
    image_mount: str = Field("auto", pattern="^(auto|kernel|fuse-dir)$",
                             description="MODELPLANE_IMAGE_MOUNT: auto | kernel (FUSE file + loop + squashfs) | fuse-dir")
    image_cache_gib: float = Field(20.0, gt=0, description="MODELPLANE_IMAGE_CACHE_GIB: local sector cache bound, per layer")
    # MODELPLANE_LAYER_CACHE_DIR: built environment layers, by environment fingerprint; default
    # <home>/images/cache. Platforms on one machine that name one directory build each layer once.
    layer_cache_dir: Path | None = None
    # MODELPLANE_EVAL_RESULTS_DIR: the eval gate's results, by (checkpoint content, evaluation set,
    # engine); default <home>/models/evaluations. Platforms that name one directory evaluate each once.
    eval_results_dir: Path | None = None
    warm_pool: int = Field(1, ge=0, le=16, description="MODELPLANE_WARM_POOL: pre-started runtime processes per "
                           "runtime kind and environment (0: none)")
    # Where replicas run (cluster/): "local" processes on this machine, or "kubernetes" (docs/kubernetes.md).
    cluster: str = Field("local", pattern="^(local|kubernetes)$", description="MODELPLANE_CLUSTER: local | kubernetes")
    k8s_namespace: str = Field("modelplane", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
                               description="MODELPLANE_K8S_NAMESPACE: where replicas' objects live")
    kubeconfig: Path | None = None  # MODELPLANE_KUBECONFIG: a kubeconfig file; unset: the pod's in-cluster config
    k8s_runtime_image: str = Field("modelplane:latest", min_length=1,
                                   description="MODELPLANE_K8S_RUNTIME_IMAGE: the platform image replica pods run")
    k8s_models_claim: str | None = "modelplane-home"  # MODELPLANE_K8S_MODELS_CLAIM: RWX claim holding MODELPLANE_HOME
    router_url_override: str | None = None  # MODELPLANE_ROUTER_URL: where run workers and sensors reach the router
    advertise_host: str | None = None  # MODELPLANE_ADVERTISE_HOST: the address a router reports for its own port
    prometheus: bool = False  # `modelplane up --prometheus`: run Prometheus and its targets writer (docs/metrics.md)
    # Liveness by forward progress (serving/runtime/liveness.py), for every replica the platform runs:
    # MODELPLANE_LIVENESS_HANG_AFTER_S, _IDLE_PROBE_AFTER_S, _PROBE_TIMEOUT_S, _UNANSWERED_AFTER_S.
    # None: LivenessConfig's default (60, 30, 30 and 20 s).
    liveness_hang_after_s: float | None = Field(None, gt=0, description="work outstanding this long with no progress: hung")
    liveness_idle_probe_after_s: float | None = Field(None, gt=0, description="idle this long: send a one-token probe")
    liveness_probe_timeout_s: float | None = Field(None, gt=0, description="a probe unanswered this long: hung")
    liveness_unanswered_after_s: float | None = Field(None, gt=0, description="/metrics unanswered this long: hung")

    @field_validator("host")
    @classmethod
    def _an_address(cls, value: str) -> str:
        import ipaddress

        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"MODELPLANE_HOST must be an IP address to listen on (127.0.0.1, 0.0.0.0, ::), "
                             f"got {value!r}") from None
        return value

    @field_validator("router_url_override")
    @classmethod
    def _an_http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"MODELPLANE_ROUTER_URL must be an http(s) URL, got {value!r}")
        return value

    @field_validator("amx")
    @classmethod
    def _known_amx_mode(cls, value: str) -> str:
        from serving.runtime.amx import MODE_ENV, MODES

        if value not in MODES:
            raise ValueError(f"{MODE_ENV} must be one of {', '.join(MODES)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _liveness_consistent(self) -> "Settings":
        self.liveness()  # its own check: an idle replica must not be judged hung sooner than a busy one
        return self

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        home = Path(env.get("MODELPLANE_HOME", REPO_ROOT / ".modelplane")).resolve()
        database_url = normalize_database_url(
            env.get("MODELPLANE_DATABASE_URL") or f"sqlite:///{home / 'controlplane.db'}"
        )
        ports = Ports(
            mlflow_port=int(env.get("MODELPLANE_MLFLOW_PORT", 5000)),
            dagster_port=int(env.get("MODELPLANE_DAGSTER_PORT", 3000)),
            admin_port=int(env.get("MODELPLANE_ADMIN_PORT", 8100)),
            router_port=int(env.get("MODELPLANE_ROUTER_PORT", 8080)),
            registry_port=int(env.get("MODELPLANE_REGISTRY_PORT", 5050)),
            prometheus_port=int(env.get("MODELPLANE_PROMETHEUS_PORT", 9090)),
        )
        return cls(
            home=home,
            database_url=database_url,
            ports=ports,
            mlflow_tracking_uri_override=env.get("MLFLOW_TRACKING_URI"),
            quantize_python=Path(env.get("MODELPLANE_QUANTIZE_PYTHON", REPO_ROOT / ".venv-quantize" / "bin" / "python")),
            amx=env.get("MODELPLANE_AMX", "auto").strip().lower() or "auto",
            routers=int(env.get("MODELPLANE_ROUTERS", 1)),
            images=env.get("MODELPLANE_IMAGES", "lazy").strip().lower() or "lazy",
            registry_url_override=env.get("MODELPLANE_REGISTRY_URL") or None,
            image_mount=env.get("MODELPLANE_IMAGE_MOUNT", "auto").strip().lower() or "auto",
            image_cache_gib=float(env.get("MODELPLANE_IMAGE_CACHE_GIB", 20)),
            layer_cache_dir=Path(env["MODELPLANE_LAYER_CACHE_DIR"]) if env.get("MODELPLANE_LAYER_CACHE_DIR") else None,
            eval_results_dir=Path(env["MODELPLANE_EVAL_RESULTS_DIR"]) if env.get("MODELPLANE_EVAL_RESULTS_DIR") else None,
            warm_pool=int(env.get("MODELPLANE_WARM_POOL", 1)),
            host=env.get("MODELPLANE_HOST", "127.0.0.1").strip() or "127.0.0.1",
            cluster=env.get("MODELPLANE_CLUSTER", "local").strip().lower() or "local",
            k8s_namespace=env.get("MODELPLANE_K8S_NAMESPACE", "modelplane").strip(),
            kubeconfig=Path(env["MODELPLANE_KUBECONFIG"]) if env.get("MODELPLANE_KUBECONFIG") else None,
            k8s_runtime_image=env.get("MODELPLANE_K8S_RUNTIME_IMAGE", "modelplane:latest").strip(),
            k8s_models_claim=env.get("MODELPLANE_K8S_MODELS_CLAIM", "modelplane-home").strip() or None,
            router_url_override=env.get("MODELPLANE_ROUTER_URL", "").strip().rstrip("/") or None,
            advertise_host=env.get("MODELPLANE_ADVERTISE_HOST", "").strip() or None,
            **{f"liveness_{name}": float(env[f"MODELPLANE_LIVENESS_{name.upper()}"]) for name in LIVENESS_SETTINGS
               if env.get(f"MODELPLANE_LIVENESS_{name.upper()}", "").strip()},
        )

    def liveness(self):
        """The forward-progress thresholds every replica is judged by (a ``LivenessConfig``)."""
        from serving.runtime.liveness import LivenessConfig

        return LivenessConfig(**{name: getattr(self, f"liveness_{name}") for name in LIVENESS_SETTINGS
                                 if getattr(self, f"liveness_{name}") is not None})

    # -- derived paths -------------------------------------------------------------------
    @property
    def mlflow_dir(self) -> Path:
        return self.home / "mlflow"

    @property
    def mlflow_backend_uri(self) -> str:
        return f"sqlite:///{self.mlflow_dir / 'mlflow.db'}"

    @property
    def mlflow_artifacts_dir(self) -> Path:
        return self.mlflow_dir / "artifacts"

    @property
    def dagster_home(self) -> Path:
        return self.home / "dagster"

    @property
    def dagster_workspace(self) -> Path:
        """The workspace the webserver and daemon load: the code server ``up`` runs, over its socket."""
        return self.dagster_home / "workspace.yaml"

    @property
    def dagster_code_socket(self) -> Path:
        """The Unix socket of ``up``'s Dagster code server: under DAGSTER_HOME where the path fits a
        socket address (107 bytes), else in the temporary directory under a name derived from the home.

        >>> Settings(home=Path("/srv/mp"), database_url="sqlite://").dagster_code_socket
        PosixPath('/srv/mp/dagster/code-server.sock')
        >>> len(str(Settings(home=Path("/" + "d" * 120), database_url="sqlite://").dagster_code_socket)) < 108
        True
        """
        path = self.dagster_home / "code-server.sock"
        if len(os.fsencode(path)) < 100:
            return path
        digest = hashlib.sha256(os.fsencode(self.home.resolve())).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"modelplane-dagster-{digest}.sock"

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def registry_dir(self) -> Path:
        return self.home / "registry"

    @property
    def images_dir(self) -> Path:
        """Image builds, the environment-layer cache, sector caches and mount points."""
        return self.home / "images"

    @property
    def prometheus_dir(self) -> Path:
        """``up --prometheus``: prometheus.yml, rules.yml, targets/ (file_sd) and data/ (its TSDB)."""
        return self.home / "prometheus"

    @property
    def secrets_path(self) -> Path:
        return self.home / "secrets.json"

    # -- URLs ----------------------------------------------------------------------------
    @property
    def mlflow_url(self) -> str:
        return f"http://{self.host}:{self.ports.mlflow_port}"

    @property
    def mlflow_tracking_uri(self) -> str:
        """The MLflow server by default; ``MLFLOW_TRACKING_URI`` wins when set."""
        return self.mlflow_tracking_uri_override or self.mlflow_url

    @property
    def dagster_url(self) -> str:
        return f"http://{self.host}:{self.ports.dagster_port}"

    @property
    def router_url(self) -> str:
        return self.router_url_override or f"http://{self.host}:{self.ports.router_port}"

    @property
    def registry_url(self) -> str:
        """The embedded registry by default; ``MODELPLANE_REGISTRY_URL`` wins when set."""
        return self.registry_url_override or f"http://{self.host}:{self.ports.registry_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.ports.admin_port}"

    @property
    def prometheus_url(self) -> str:
        """Always loopback, whatever ``MODELPLANE_HOST`` says: Prometheus has no authentication."""
        return f"http://127.0.0.1:{self.ports.prometheus_port}"

    def ensure_dirs(self) -> None:
        """Create the state directories, readable by their owner only (0700): they hold the
        databases, the logs (which may show request bodies) and the secrets."""
        for path in (self.home, self.mlflow_artifacts_dir, self.dagster_home, self.models_dir, self.logs_dir):
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            path.chmod(0o700)

    def secrets(self) -> "Secrets":
        return Secrets.load_or_create(self.secrets_path)


class Secrets(BaseModel):
    """Generated once per installation and kept in ``secrets.json`` (mode 0600)."""

    webhook_secret: str
    mlflow_webhook_encryption_key: str

    @classmethod
    def load_or_create(cls, path: Path) -> "Secrets":
        if path.exists():
            return cls.model_validate_json(path.read_text())
        from cryptography.fernet import Fernet

        created = cls(
            webhook_secret=secrets.token_urlsafe(32),
            mlflow_webhook_encryption_key=Fernet.generate_key().decode(),
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(created.model_dump(), f)
        return created


def normalize_database_url(url: str) -> str:
    """Use the psycopg 3 driver for plain ``postgresql://`` URLs.

    >>> normalize_database_url("postgresql://postgres@127.0.0.1:5432/test")
    'postgresql+psycopg://postgres@127.0.0.1:5432/test'
    """
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url
