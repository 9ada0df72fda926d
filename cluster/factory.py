"""The one place that turns settings into a backend: every process that needs the cluster asks here.

Deploy steps (through ``pipelines.resources.ClusterResource``), the autoscaler and the routers
see only the ``Cluster`` Protocol; which backend stands behind it is ``MODELPLANE_CLUSTER``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine

from cluster.protocol import Cluster, Replica
from serving.runtime.liveness import LivenessConfig


def kubernetes_api(kubeconfig: Path | None):
    """An API client from a kubeconfig file, or from the pod's service account when there is none."""
    from kubernetes import client, config

    if kubeconfig is not None:
        if not Path(kubeconfig).is_file():
            raise ValueError(f"MODELPLANE_KUBECONFIG {kubeconfig} is not a file")
        return config.new_client_from_config(config_file=str(kubeconfig))
    try:
        config.load_incluster_config()
    except config.ConfigException as exc:
        raise ValueError("MODELPLANE_CLUSTER=kubernetes outside a pod needs MODELPLANE_KUBECONFIG "
                         f"(a kubeconfig file): {exc}") from None
    return client.ApiClient()


def make_cluster(backend: str, engine: Engine, *, namespace: str = "modelplane", kubeconfig: Path | None = None,
                 runtime_image: str = "modelplane:latest", models_claim: str | None = "modelplane-home",
                 home_path: str = "/var/lib/modelplane", liveness: LivenessConfig | None = None) -> Cluster:
    if backend == "local":
        from cluster.local.backend import LocalCluster

        return LocalCluster(engine)
    if backend == "kubernetes":
        from cluster.kubernetes.backend import KubernetesCluster
        from cluster.kubernetes.config import KubernetesConfig

        config = KubernetesConfig(namespace=namespace, runtime_image=runtime_image, models_claim=models_claim,
                                  home_path=home_path, liveness=liveness or LivenessConfig())
        return KubernetesCluster(kubernetes_api(kubeconfig), config)
    raise ValueError(f"unknown cluster backend {backend!r}; known: local, kubernetes")


def from_settings(settings, engine: Engine) -> Cluster:
    return make_cluster(settings.cluster, engine, namespace=settings.k8s_namespace, kubeconfig=settings.kubeconfig,
                        runtime_image=settings.k8s_runtime_image, models_claim=settings.k8s_models_claim,
                        home_path=str(settings.home), liveness=settings.liveness())


class ReplicaFeed:
    """The latest replica list from a backend's ``watch``, kept by a daemon thread (the routers' discovery)."""

    def __init__(self, cluster: Cluster, on_error: Callable[[Exception], None] = lambda exc: None) -> None:
        self._latest: list[Replica] | None = None
        self._cluster, self._on_error = cluster, on_error
        self._seen, self._closed = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-feed", daemon=True)
        self._thread.start()

    def current(self) -> list[Replica]:
        """The replicas as last seen; waits up to 10 s for the first list, then answers with none."""
        self._seen.wait(10.0)
        return list(self._latest or [])

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop watching; returns once the watch has ended (its stream ends or times out)."""
        self._closed.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                for replicas in self._cluster.watch(stop=self._closed.is_set):
                    self._latest = replicas
                    self._seen.set()
            except Exception as exc:  # noqa: BLE001 - a watch that gives up is started again
                self._on_error(exc)
                self._closed.wait(1.0)
