"""``KubernetesCluster``: the Cluster Protocol on a Kubernetes API server, through the official client.

- ``apply``: server-side apply (field manager ``modelplane``) of the revision's Deployment,
  then its Service and PodDisruptionBudget, owned by the Deployment. Applying is idempotent,
  so a revision half-created by a crash is finished by the next ``apply`` or ``converge``.
- ``scale``: through the Deployment's ``scale`` subresource, with the resourceVersion read
  just before (a 409 Conflict is retried on a fresh read). Named victims get the lowest
  ``controller.kubernetes.io/pod-deletion-cost`` first, so the ReplicaSet controller stops
  them first; the rest of a drop is the controller's choice (not ready first, then newest).
- ``replicas`` and ``watch``: the EndpointSlices of the revisions' Services
  (:mod:`cluster.kubernetes.discovery`).
- ``delete``: the Deployment (its pods and owned objects go with it) and, explicitly, the
  Service and the budget.
- ``converge``: finishes revisions with an object missing and deletes every modelplane object
  whose revision is not active, so nothing is orphaned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from kubernetes.client import ApiClient, AppsV1Api, CoreV1Api, DiscoveryV1Api, PolicyV1Api
from kubernetes.client.rest import ApiException

from cluster.kubernetes import manifests
from cluster.kubernetes.config import (DELETION_COST, FIELD_MANAGER, REVISION_ANNOTATION, REVISION_LABEL,
                                       KubernetesConfig)
from cluster.kubernetes.discovery import SELECTOR, SliceWatcher, list_slices, replicas_from_slices
from cluster.protocol import Replica, RevisionSpec

APPLY = "application/apply-patch+yaml"
CONFLICT_RETRIES = 5


class KubernetesCluster:
    def __init__(self, api_client: ApiClient, config: KubernetesConfig = KubernetesConfig(),
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config
        self._apps, self._core = AppsV1Api(api_client), CoreV1Api(api_client)
        self._policy, self._discovery = PolicyV1Api(api_client), DiscoveryV1Api(api_client)
        self._sleep = sleep
        self._revision_ids: dict[str, str] = {}  # object name → revision id

    # ---- the Protocol ---------------------------------------------------------------------

    def apply(self, spec: RevisionSpec) -> None:
        deployment = manifests.deployment(spec, self.config)  # ValueError before anything is written
        name, ns = manifests.object_name(spec.revision_id), self.config.namespace
        self._revision_ids[name] = spec.revision_id
        created = self._apps.patch_namespaced_deployment(name, ns, deployment, field_manager=FIELD_MANAGER,
                                                         force=True, _content_type=APPLY)
        owner = manifests.owner_reference({"metadata": {"name": name, "uid": created.metadata.uid}})
        self._core.patch_namespaced_service(name, ns, manifests.service(spec, self.config, owner),
                                            field_manager=FIELD_MANAGER, force=True, _content_type=APPLY)
        self._policy.patch_namespaced_pod_disruption_budget(
            name, ns, manifests.disruption_budget(spec, self.config, owner), field_manager=FIELD_MANAGER,
            force=True, _content_type=APPLY)

    def scale(self, revision_id: str, replicas: int, victims: Sequence[str] = ()) -> None:
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        name, ns = manifests.object_name(revision_id), self.config.namespace
        for attempt in range(CONFLICT_RETRIES):
            try:
                current = self._apps.read_namespaced_deployment_scale(name, ns)
            except ApiException as exc:
                if exc.status == 404:
                    raise KeyError(f"no revision {revision_id!r} (no Deployment {ns}/{name})") from None
                raise
            if replicas < (current.spec.replicas or 0):
                self._mark_victims(name, list(victims)[:current.spec.replicas - replicas])
            body = {"apiVersion": "autoscaling/v1", "kind": "Scale",
                    "metadata": {"name": name, "namespace": ns, "resourceVersion": current.metadata.resource_version},
                    "spec": {"replicas": replicas}}
            try:
                self._apps.replace_namespaced_deployment_scale(name, ns, body)
                return
            except ApiException as exc:
                if exc.status != 409 or attempt == CONFLICT_RETRIES - 1:
                    raise
                self._sleep(0.05 * (attempt + 1))  # someone else wrote in between: read again

    def replicas(self, revision_id: str | None = None) -> list[Replica]:
        selector = SELECTOR
        if revision_id is not None:
            selector += f",{REVISION_LABEL}={manifests.object_name(revision_id)}"
        slices, _ = list_slices(self._discovery, self.config.namespace, selector)
        return replicas_from_slices(slices, self.revision_of)

    def desired_replicas(self, revision_id: str) -> int:
        """The Deployment's count, as its scale subresource says (the autoscaler's last word)."""
        try:
            scale = self._apps.read_namespaced_deployment_scale(manifests.object_name(revision_id),
                                                                self.config.namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise KeyError(f"no revision {revision_id!r}") from None
            raise
        return scale.spec.replicas or 0

    def watch(self, interval_s: float = 0.5, stop: Callable[[], bool] = lambda: False) -> Iterator[list[Replica]]:
        """Change notifications from the API server (``interval_s``: the pause after a broken watch)."""
        return SliceWatcher(self._discovery, self.config.namespace, self.revision_of,
                            watch_timeout_s=self.config.watch_timeout_s, retry_s=interval_s).changes(stop)

    def delete(self, revision_id: str) -> None:
        self._delete_objects(manifests.object_name(revision_id))

    def converge(self, active: Sequence[RevisionSpec]) -> list[str]:
        """Finish active revisions that miss an object; delete the objects of every other revision."""
        wanted = {manifests.object_name(spec.revision_id): spec for spec in active}
        present = self._managed_objects()
        changed = []
        for name in sorted(set(present) - set(wanted)):
            self._delete_objects(name)
            changed.append(f"deleted {name}")
        for name, spec in sorted(wanted.items()):
            kinds = present.get(name, {})
            if {"Deployment", "Service", "PodDisruptionBudget"} <= set(kinds):
                continue
            live = kinds.get("Deployment")
            replicas = live.spec.replicas if live is not None else spec.replicas  # never undo a scale
            self.apply(RevisionSpec(spec.revision_id, spec.endpoint, spec.model_dir, spec.runtime, replicas,
                                    spec.runtime_config, spec.image, spec.expected_start_s))
            changed.append(f"finished {name}")
        return changed

    # ---- helpers --------------------------------------------------------------------------

    def revision_of(self, name: str) -> str:
        """The revision id an object name stands for (its Service's annotation), else the name."""
        if name not in self._revision_ids:
            try:
                service = self._core.read_namespaced_service(name, self.config.namespace)
                self._revision_ids[name] = (service.metadata.annotations or {}).get(REVISION_ANNOTATION, name)
            except ApiException:
                return name
        return self._revision_ids[name]

    def _mark_victims(self, name: str, victims: list[str]) -> None:
        """The first victim gets the lowest deletion cost; the other pods lose any cost left from before."""
        pods = self._core.list_namespaced_pod(self.config.namespace, label_selector=f"{REVISION_LABEL}={name}")
        order = {pod_name: i for i, pod_name in enumerate(victims)}
        for pod in pods.items:
            cost = str(-1_000_000 + order[pod.metadata.name]) if pod.metadata.name in order else None
            if (pod.metadata.annotations or {}).get(DELETION_COST) != cost:
                self._core.patch_namespaced_pod(pod.metadata.name, self.config.namespace,
                                                {"metadata": {"annotations": {DELETION_COST: cost}}})

    def _managed_objects(self) -> dict[str, dict[str, object]]:
        ns, found = self.config.namespace, {}
        for kind, lister in (("Deployment", self._apps.list_namespaced_deployment),
                             ("Service", self._core.list_namespaced_service),
                             ("PodDisruptionBudget", self._policy.list_namespaced_pod_disruption_budget)):
            for item in lister(ns, label_selector=SELECTOR).items:
                name = (item.metadata.labels or {}).get(REVISION_LABEL, item.metadata.name)
                found.setdefault(name, {})[kind] = item
        return found

    def _delete_objects(self, name: str) -> None:
        ns = self.config.namespace
        for deleter in (lambda: self._apps.delete_namespaced_deployment(name, ns, propagation_policy="Background"),
                        lambda: self._core.delete_namespaced_service(name, ns),
                        lambda: self._policy.delete_namespaced_pod_disruption_budget(name, ns)):
            try:
                deleter()
            except ApiException as exc:
                if exc.status != 404:
                    raise
