"""Dagster resources: thin, configurable wrappers that hand out the adapters.

The same resource keys are used everywhere (``control_plane``, ``registry``,
``model_store``); ``pipelines/definitions.py`` builds them from ``Settings``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from dagster import ConfigurableResource, PipesClientCompletedInvocation, PipesSubprocessClient
from pydantic import Field
from sqlalchemy import Engine

from assets.metadata import mlflow_web
from cluster.capacity import GIB, Capacity, local_capacity
from cluster.hardware import HardwareProfile, detect_local
from cluster.protocol import Cluster
from controlplane.db import make_engine
from controlplane.settings import OFFLINE_ENV, REPO_ROOT, normalize_database_url
from controlplane.store import EndpointStore, WebhookInbox
from pipelines.registry import MlflowRegistry, ModelRegistry


@lru_cache(maxsize=8)
def _engine(database_url: str) -> Engine:
    return make_engine(normalize_database_url(database_url))


class ControlPlaneResource(ConfigurableResource):
    """The control-plane database: endpoint specs and the webhook inbox."""

    database_url: str = Field(description="SQLAlchemy URL of the control-plane database.")
    router_url: str = Field("http://127.0.0.1:8080", description="Where clients reach the router.")

    def engine(self) -> Engine:
        return _engine(self.database_url)

    def endpoints(self) -> EndpointStore:
        return EndpointStore(_engine(self.database_url))

    def inbox(self) -> WebhookInbox:
        return WebhookInbox(_engine(self.database_url))


class ClusterResource(ConfigurableResource):
    """Where replicas run: ``local`` processes on this machine, run by the supervisor, or ``kubernetes``."""

    backend: str = Field("local", pattern="^(local|kubernetes)$", description="Cluster backend: local | kubernetes.")
    database_url: str = Field(description="Control-plane database (the local backend's desired state).")
    memory_gib: float | None = Field(None, gt=0, description="Memory all replicas may use together, GiB; none "
                                     "means this machine's memory (or its cgroup limit). Specs whose min_replicas "
                                     "do not fit are refused. Kubernetes: the scheduler decides; unset.")
    namespace: str = Field("modelplane", description="Kubernetes: the namespace of the replicas' objects.")
    kubeconfig: str | None = Field(None, description="Kubernetes: a kubeconfig file; none: the in-cluster config.")
    runtime_image: str = Field("modelplane:latest", description="Kubernetes: the platform image replica pods run.")
    models_claim: str | None = Field("modelplane-home", description="Kubernetes: the ReadWriteMany claim holding "
                                     "MODELPLANE_HOME, for revisions without a serving image.")
    home_path: str = Field(str(REPO_ROOT / ".modelplane"), description="Kubernetes: where that claim is mounted.")

    def client(self) -> Cluster:
        from cluster.factory import make_cluster

        return make_cluster(self.backend, _engine(self.database_url), namespace=self.namespace,
                            kubeconfig=Path(self.kubeconfig) if self.kubeconfig else None,
                            runtime_image=self.runtime_image, models_claim=self.models_claim, home_path=self.home_path)

    def hardware_profile(self) -> HardwareProfile:
        """What the backend's replicas run on. Local: this machine. Kubernetes: the node this run's pod
        is on, which is the replicas' hardware when they share a node pool (docs/kubernetes.md)."""
        return detect_local()

    def capacity(self) -> Capacity:
        """What the backend's replicas may use in all (local: this machine's memory)."""
        if self.memory_gib is not None:
            return Capacity(int(self.memory_gib * GIB), f"the cluster resource's memory_gib ({self.memory_gib:g})")
        if self.backend == "kubernetes":
            return Capacity(1 << 60, "the Kubernetes scheduler (a pod that fits no node stays Pending)")
        return local_capacity()


class RegistryResource(ConfigurableResource):
    """The MLflow model registry."""

    tracking_uri: str = Field(description="MLflow tracking/registry URI (http://… or sqlite:///…).")
    ui_url: str | None = Field(None, description="Where a browser reaches the MLflow UI, for links in the Dagster "
                               "UI; none: the tracking URI when it is http(s), else no links.")

    def client(self) -> ModelRegistry:
        return MlflowRegistry(self.tracking_uri)

    def web_url(self) -> str | None:
        """The MLflow UI's base URL, or None when there is none to link to."""
        return mlflow_web(self.tracking_uri, self.ui_url)


class QuantizerResource(ConfigurableResource):
    """The quantization worker: ``quantization/worker.py`` in the quantization environment, via Pipes."""

    python: str = Field(description="Interpreter of the quantization environment, e.g. .venv-quantize/bin/python.")
    worker: str = Field(str(REPO_ROOT / "quantization" / "worker.py"), description="The worker script it runs.")

    def run(self, context, extras: dict) -> PipesClientCompletedInvocation:
        if not Path(self.python).is_file():
            raise FileNotFoundError(f"the quantization environment's interpreter {self.python} does not exist; "
                                    "run `make envs` (or set MODELPLANE_QUANTIZE_PYTHON)")
        client = PipesSubprocessClient(cwd=str(REPO_ROOT), env={**OFFLINE_ENV, "PYTHONPATH": str(REPO_ROOT)})
        return client.run(command=[self.python, self.worker], context=context, extras=extras)


class ModelStoreResource(ConfigurableResource):
    """Local directory where deploy steps keep downloaded and derived model files."""

    root_dir: str = Field(description="Directory under MODELPLANE_HOME, e.g. .modelplane/models.")
    evaluations_root: str | None = Field(None, description="The eval gate's results (default: <root_dir>/evaluations). "
                                         "Platforms that name one directory evaluate each checkpoint once; one waits "
                                         "for another.")

    def version_dir(self, model: str, version: str, step: str) -> Path:
        return Path(self.root_dir) / model / f"v{version}" / step

    def quantized_dir(self) -> Path:
        """Quantized checkpoints by what decides their bytes, shared by every version
        (``quantization.store``)."""
        return Path(self.root_dir) / "quantized"

    def evaluations_dir(self) -> Path:
        """The eval gate's results, one file per (checkpoint content, evaluation set, engine), shared by
        every version (``evaluation.engine_run``)."""
        return Path(self.evaluations_root) if self.evaluations_root else Path(self.root_dir) / "evaluations"


class ImagesResource(ConfigurableResource):
    """Serving images (``images/``): where they are pushed and how they are built."""

    mode: str = Field("lazy", pattern="^(lazy|off)$", description="lazy: build each served version's OCI image and "
                      "its seekable form, and start replicas from it; off: build none, start replicas in place.")
    registry_url: str = Field("http://127.0.0.1:5050", description="OCI registry (the embedded one by default).")
    username: str | None = Field(None, description="Registry user (basic auth, or the token service's).")
    password: str | None = Field(None, description="Registry password or token.")
    repo_prefix: str = Field("modelplane", description="Repositories are <prefix>/<model>.")
    work_dir: str = Field(description="Builds and the environment-layer cache, e.g. .modelplane/images.")
    layer_cache_dir: str | None = Field(None, description="Built environment layers, one per environment "
                                        "fingerprint (default: <work_dir>/cache). Builders that name one "
                                        "directory build each environment's layer once; one waits for another.")
    sector_bytes: int = Field(4 << 20, ge=4096, multiple_of=4096, description="Seekable sector size, bytes.")
    zstd_level: int = Field(3, ge=1, le=22, description="zstd level of the squashfs blocks and the sectors.")
    trace_startup: bool = Field(True, description="Record the files the runtime opens while starting (strace) "
                                "and place them first in each layer.")

    def layer_cache(self) -> Path:
        return Path(self.layer_cache_dir) if self.layer_cache_dir else Path(self.work_dir) / "cache"

    def client(self):
        from images.oci.client import HttpRegistry

        return HttpRegistry(self.registry_url, username=self.username, password=self.password)

    def settings(self):
        from images.serving_image import ImageSettings

        return ImageSettings(sector_bytes=self.sector_bytes, zstd_level=self.zstd_level,
                             trace_startup=self.trace_startup)
