"""The emulated control plane: Deployment controller, EndpointSlice controller, garbage
collector, scheduler and kubelet, in-process and deterministic.

They run on changes, not on timers: after every write request the server serves and after
every test-side call here (``auto=True``), ``reconcile()`` runs the controllers until nothing
changes, synchronously, before the request is answered. Every change they make goes through
the same ``Api`` (so it bumps resourceVersion and produces watch events like any write).

What each does, and where it departs from the real one:

- Deployment controller: keeps ``spec.replicas`` pods per Deployment, named
  ``<deployment>-<5 chars>``, labelled with the template's labels plus ``pod-template-hash``,
  owned by the Deployment directly (the real chain goes through a ReplicaSet; it is skipped).
  Scale-down picks victims as the ReplicaSet controller does, restricted to what differs on a
  one-node cluster: not running before running, not ready before ready, lower
  ``controller.kubernetes.io/pod-deletion-cost`` first, then newest first (readiness age and
  restart counts are not compared). A changed pod template rolls out at once: every old pod
  is deleted (terminates) and all new pods are created together, not ready (no surge or
  unavailability budget). It writes ``status`` (replicas, updatedReplicas, readyReplicas,
  availableReplicas, unavailableReplicas, observedGeneration, Available/Progressing) with
  zero counts omitted, as the API serialises them.
- Garbage collector: an object whose ownerReferences all name absent uids is deleted; an
  owner deleted with ``propagationPolicy=Foreground`` waits (finalizer ``foregroundDeletion``)
  until its dependents with ``blockOwnerDeletion`` are gone, pods included.
- Scheduler and kubelet: pods go to one node (``node-1``), get an IP from ``pod_address`` and
  run, NOT ready until the test calls ``set_ready``. A deleted pod terminates gracefully:
  it keeps ``deletionTimestamp`` until ``finish_terminating()`` (or at once when
  ``terminate_immediately``).
- EndpointSlice controller: per Service with a selector, slices labelled
  ``kubernetes.io/service-name`` and ``endpointslice.kubernetes.io/managed-by`` plus the
  Service's own labels, owned by the Service, IPv4, one endpoint per running pod with
  conditions ready (= serving and not terminating), serving (= the pod's readiness),
  terminating; ports from the Service's ports with ``port`` = targetPort. Pods whose
  ``pod_address`` gave them their own port get their own slice (the slice's ports differ),
  so a consumer must merge all slices of a service, as it must against a real cluster. A
  Service with no endpoints keeps one empty placeholder slice, as the real controller does.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from typing import Any

from tests.kube_mock.api import Api, now, random_suffix
from tests.kube_mock.store import KINDS, selector_matches

DEPLOYMENTS, PODS, SERVICES, SLICES = (KINDS[k] for k in ("deployments", "pods", "services", "endpointslices"))
MANAGER = "kube-controller-manager"
SERVICE_NAME = "kubernetes.io/service-name"
MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
SLICE_CONTROLLER = "endpointslice-controller.k8s.io"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

PodAddress = Callable[[dict], "tuple[str, int | None] | None"]


def _is_ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _owner_uid(obj: dict) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def _template_hash(template: dict) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _deletion_cost(pod: dict) -> int:
    try:
        return int((pod["metadata"].get("annotations") or {}).get(DELETION_COST, 0))
    except ValueError:
        return 0


def _scaled(value: Any, total: int) -> int:
    """maxUnavailable as the API resolves it: an int, or a percentage of replicas rounded down."""
    if isinstance(value, str) and value.endswith("%"):
        return total * int(value[:-1]) // 100
    return int(value or 0)


class ClusterEmulator:
    """Controllers and a kubelet for one node; attach to a ``KubeMock`` by passing it in.

    ``pod_address(pod) -> (ip, port)``: where a pod listens; ``port=None`` means the Service's
    targetPort. Called once per pod, when the kubelet starts it, from whichever thread made the
    change (keep it quick; it may start a local server). Default: 10.0.x.y and no own port.
    ``on_pod_removed(pod)``: called when a pod is gone for good (to stop such a server).
    """

    def __init__(self, pod_address: PodAddress | None = None, *, auto: bool = True,
                 terminate_immediately: bool = False, node_name: str = "node-1", seed: int = 0,
                 on_pod_removed: Callable[[dict], None] | None = None) -> None:
        self.pod_address = pod_address
        self.auto = auto
        self.terminate_immediately = terminate_immediately
        self.node_name = node_name
        self.on_pod_removed = on_pod_removed
        self.seed = seed
        self._api: Api | None = None
        self._ports: dict[str, int | None] = {}  # pod uid -> its own port
        self._created: dict[str, int] = {}  # pod uid -> creation order
        self._running: dict[str, dict] = {}  # pod uid -> the pod, while it exists
        self._ip_counter = 0

    def attach(self, api: Api) -> None:
        self._api = api

    @property
    def api(self) -> Api:
        assert self._api is not None, "the emulator is not attached to a KubeMock"
        return self._api

    # --- test-side controls

    def set_ready(self, pod_name: str, ready: bool = True, namespace: str | None = None) -> dict:
        """Flip a pod's readiness (its Ready condition), as its readiness probe would."""
        with self.api.store.lock:
            pod = self._find_pod(pod_name, namespace)
            status = copy.deepcopy(pod.get("status") or {})
            value = "True" if ready else "False"
            for condition in status.setdefault("conditions", []):
                if condition["type"] in ("Ready", "ContainersReady") and condition["status"] != value:
                    condition.update(status=value, lastTransitionTime=now())
            for container in status.get("containerStatuses") or []:
                container["ready"] = ready
            pod = self.api.update_status(PODS, pod["metadata"]["namespace"], pod_name, status, manager="kubelet")
            self._maybe_reconcile()
            return pod

    def set_all_ready(self, deployment: str, ready: bool = True, namespace: str | None = None) -> list[str]:
        """Set every live (not terminating) pod of a Deployment ready (or not); their names."""
        names = [p["metadata"]["name"] for p in self.pods(deployment, namespace, terminating=False)]
        for name in names:
            self.set_ready(name, ready, namespace)
        return names

    def finish_terminating(self, pod_name: str | None = None, namespace: str | None = None) -> list[str]:
        """Let terminating pods (all, or one) finish: they disappear. Their names."""
        with self.api.store.lock:
            pods = [p for p in self.api.store.list(PODS, namespace)[0] if p["metadata"].get("deletionTimestamp")
                    and pod_name in (None, p["metadata"]["name"])]
            for pod in pods:
                self.api.finish_deletion(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"])
            self._maybe_reconcile()
            return [p["metadata"]["name"] for p in pods]

    def pods(self, deployment: str | None = None, namespace: str | None = None,
             terminating: bool | None = None) -> list[dict]:
        """Pods (of one Deployment, by ownership), oldest first; ``terminating`` filters by it."""
        with self.api.store.lock:
            owners = {d["metadata"]["uid"] for d in self.api.store.list(DEPLOYMENTS, namespace)[0]
                      if deployment in (None, d["metadata"]["name"])}
            pods = [p for p in self.api.store.list(PODS, namespace)[0]
                    if (deployment is None or _owner_uid(p) in owners)
                    and terminating in (None, bool(p["metadata"].get("deletionTimestamp")))]
            return sorted(pods, key=lambda p: self._created.get(p["metadata"]["uid"], 0))

    # --- reconciliation

    def after_api_write(self) -> None:
        self._maybe_reconcile()

    def _maybe_reconcile(self) -> None:
        if self.auto:
            self.reconcile()

    def reconcile(self) -> None:
        """Run every controller until the cluster stops changing."""
        with self.api.store.lock:
            for _ in range(50):
                revision = self.api.store.rv
                self._collect_garbage()
                self._deployments()
                self._kubelet()
                self._endpoint_slices()
                self._deployment_status()
                if self.api.store.rv == revision:
                    return
            raise RuntimeError("kube_mock's controllers did not settle in 50 rounds")

    def _collect_garbage(self) -> None:
        objects = self.api.store.all_objects()
        uids = {obj["metadata"]["uid"] for _, obj in objects}
        for kind, obj in objects:
            meta = obj["metadata"]
            refs = meta.get("ownerReferences") or []
            if refs and not meta.get("deletionTimestamp") and not any(r.get("uid") in uids for r in refs):
                self.api.delete(kind, meta["namespace"], meta["name"], propagation="Background")
        for kind, obj in objects:
            meta = obj["metadata"]
            if not meta.get("deletionTimestamp") or "foregroundDeletion" not in (meta.get("finalizers") or []):
                continue
            blocking = False
            for dep_kind, dep in self.api.dependents(meta["uid"]):
                if not dep["metadata"].get("deletionTimestamp"):
                    self.api.delete(dep_kind, dep["metadata"]["namespace"], dep["metadata"]["name"])
                refs = [r for r in dep["metadata"]["ownerReferences"] if r.get("uid") == meta["uid"]]
                if any(r.get("blockOwnerDeletion") for r in refs) and self.api.store.get(
                        dep_kind, dep["metadata"]["namespace"], dep["metadata"]["name"]) is not None:
                    blocking = True
            if not blocking:
                current = self.api.store.get(kind, meta["namespace"], meta["name"])
                if current is not None:
                    current["metadata"]["finalizers"] = [f for f in current["metadata"]["finalizers"]
                                                         if f != "foregroundDeletion"]
                    self.api.replace(kind, meta["namespace"], meta["name"], current, manager="garbage-collector")

    def _deployments(self) -> None:
        for dep in self.api.store.list(DEPLOYMENTS)[0]:
            meta, spec = dep["metadata"], dep["spec"]
            if meta.get("deletionTimestamp"):
                continue
            ns, template_hash = meta["namespace"], _template_hash(spec["template"])
            live = [p for p in self.api.store.list(PODS, ns)[0]
                    if _owner_uid(p) == meta["uid"] and not p["metadata"].get("deletionTimestamp")]
            for pod in live:
                if pod["metadata"].get("labels", {}).get("pod-template-hash") != template_hash:
                    self.api.delete(PODS, ns, pod["metadata"]["name"])  # the rollout: old pods go
            current = [p for p in live if p["metadata"].get("labels", {}).get("pod-template-hash") == template_hash]
            missing = spec["replicas"] - len(current)
            for _ in range(max(missing, 0)):
                self._create_pod(dep, template_hash)
            if missing < 0:
                for victim in sorted(current, key=self._victim_rank)[:-missing]:
                    self.api.delete(PODS, ns, victim["metadata"]["name"])

    def _victim_rank(self, pod: dict) -> tuple:
        running = (pod.get("status") or {}).get("phase") == "Running"
        return (running, _is_ready(pod), _deletion_cost(pod), -self._created.get(pod["metadata"]["uid"], 0))

    def _create_pod(self, dep: dict, template_hash: str) -> None:
        meta, template = dep["metadata"], copy.deepcopy(dep["spec"]["template"])
        template_meta = template.get("metadata") or {}
        while True:
            name = f"{meta['name']}-{random_suffix(self.api.rng)}"
            if self.api.store.get(PODS, meta["namespace"], name) is None:
                break
        pod_meta: dict[str, Any] = {
            "name": name, "namespace": meta["namespace"],
            "labels": dict(template_meta.get("labels") or {}, **{"pod-template-hash": template_hash}),
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
                                 "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]}
        if template_meta.get("annotations"):
            pod_meta["annotations"] = template_meta["annotations"]
        spec = dict(template.get("spec") or {}, nodeName=self.node_name)
        pod = self.api.create(PODS, meta["namespace"], {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta,
                                                        "spec": spec}, manager=MANAGER)
        self._created[pod["metadata"]["uid"]] = len(self._created) + 1

    def _kubelet(self) -> None:
        pods = self.api.store.list(PODS)[0]
        present = {p["metadata"]["uid"] for p in pods}
        for uid in list(self._running):
            if uid not in present:
                gone = self._running.pop(uid)
                self._ports.pop(uid, None)
                if self.on_pod_removed is not None:
                    self.on_pod_removed(gone)
        for pod in pods:
            meta, spec = pod["metadata"], pod.get("spec") or {}
            ns, name = meta["namespace"], meta["name"]
            if not spec.get("nodeName"):  # the scheduler binds it to the only node
                pod = self.api.replace(PODS, ns, name, dict(pod, spec=dict(spec, nodeName=self.node_name)),
                                       manager="default-scheduler")
            if meta.get("deletionTimestamp"):
                if self.terminate_immediately:
                    self.api.finish_deletion(PODS, ns, name)
                continue
            if meta["uid"] not in self._running:
                self._start(pod)

    def _start(self, pod: dict) -> None:
        meta = pod["metadata"]
        self._created.setdefault(meta["uid"], len(self._created) + 1)
        address = self.pod_address(pod) if self.pod_address is not None else None
        if address is None:
            self._ip_counter += 1
            address = (f"10.0.{self._ip_counter // 250}.{self._ip_counter % 250 + 1}", None)
        ip, port = address
        self._ports[meta["uid"]] = port
        self._running[meta["uid"]] = pod
        stamp = now()
        conditions = [{"type": t, "status": "True" if t in ("Initialized", "PodScheduled") else "False",
                       "lastProbeTime": None, "lastTransitionTime": stamp}
                      for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")]
        containers = [{"name": c.get("name"), "image": c.get("image"), "ready": False, "restartCount": 0,
                       "imageID": f"{c.get('image')}@sha256:{hashlib.sha256(str(c.get('image')).encode()).hexdigest()}",
                       "containerID": f"containerd://{meta['uid'].replace('-', '')}",
                       "started": True, "state": {"running": {"startedAt": stamp}}}
                      for c in (pod.get("spec") or {}).get("containers") or []]
        status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "192.168.0.10",
                  "startTime": stamp, "conditions": conditions, "containerStatuses": containers,
                  "qosClass": "BestEffort"}
        self.api.update_status(PODS, meta["namespace"], meta["name"], status, manager="kubelet")

    def _endpoint_slices(self) -> None:
        for svc in self.api.store.list(SERVICES)[0]:
            meta, spec = svc["metadata"], svc["spec"]
            if not spec.get("selector") or meta.get("deletionTimestamp"):
                continue
            ns = meta["namespace"]
            wanted = [(key, "=", frozenset([value])) for key, value in spec["selector"].items()]
            groups: dict[str, tuple[list[dict], list[dict]]] = {}
            pods = sorted(self.api.store.list(PODS, ns)[0], key=lambda p: p["metadata"]["name"])
            for pod in pods:
                status = pod.get("status") or {}
                if not selector_matches(wanted, pod["metadata"].get("labels")) or not status.get("podIP") \
                        or status.get("phase") in ("Succeeded", "Failed"):
                    continue
                ports = self._endpoint_ports(svc, pod)
                serving, terminating = _is_ready(pod), bool(pod["metadata"].get("deletionTimestamp"))
                endpoint = {"addresses": [status["podIP"]],
                            "conditions": {"ready": serving and not terminating, "serving": serving,
                                           "terminating": terminating},
                            "nodeName": pod["spec"].get("nodeName"),
                            "targetRef": {"kind": "Pod", "namespace": ns, "name": pod["metadata"]["name"],
                                          "uid": pod["metadata"]["uid"]}}
                groups.setdefault(json.dumps(ports, sort_keys=True), (ports, []))[1].append(endpoint)
            if not groups:
                groups[json.dumps([])] = ([], [])  # the placeholder slice
            self._sync_slices(svc, groups)

    def _endpoint_ports(self, svc: dict, pod: dict) -> list[dict]:
        own = self._ports.get(pod["metadata"]["uid"])
        container_ports = {p.get("name"): p.get("containerPort")
                           for c in pod["spec"].get("containers") or [] for p in c.get("ports") or []}
        ports = []
        for index, port in enumerate(svc["spec"].get("ports") or []):
            target = port.get("targetPort", port.get("port"))
            number = container_ports.get(target) if isinstance(target, str) else target
            if own is not None and index == 0:
                number = own
            if number is not None:
                ports.append({"name": port.get("name", ""), "port": number, "protocol": port.get("protocol", "TCP")})
        return ports

    def _sync_slices(self, svc: dict, groups: dict[str, tuple[list[dict], list[dict]]]) -> None:
        meta, ns = svc["metadata"], svc["metadata"]["namespace"]
        labels = dict(meta.get("labels") or {}, **{SERVICE_NAME: meta["name"], MANAGED_BY: SLICE_CONTROLLER})
        existing = {}
        for slice_ in self.api.store.list(SLICES, ns)[0]:
            slice_labels = slice_["metadata"].get("labels") or {}
            if slice_labels.get(SERVICE_NAME) == meta["name"] and slice_labels.get(MANAGED_BY) == SLICE_CONTROLLER:
                key = json.dumps(slice_.get("ports") or [], sort_keys=True)
                if key in groups and key not in existing:
                    existing[key] = slice_
                else:  # no endpoints with these ports any more, or a duplicate
                    self.api.delete(SLICES, ns, slice_["metadata"]["name"])
        owner = [{"apiVersion": "v1", "kind": "Service", "name": meta["name"], "uid": meta["uid"],
                  "controller": True, "blockOwnerDeletion": True}]
        for key, (ports, endpoints) in groups.items():
            current = existing.get(key)
            if current is None:
                self.api.create(SLICES, ns, {
                    "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {"generateName": f"{meta['name']}-", "namespace": ns, "labels": labels,
                                 "ownerReferences": owner},
                    "addressType": "IPv4", "endpoints": endpoints, "ports": ports}, manager=MANAGER)
            elif (current.get("endpoints"), current["metadata"].get("labels")) != (endpoints, labels):
                current["metadata"]["labels"] = labels
                current["endpoints"] = endpoints
                self.api.replace(SLICES, ns, current["metadata"]["name"], current, manager=MANAGER)

    def _deployment_status(self) -> None:
        for dep in self.api.store.list(DEPLOYMENTS)[0]:
            meta, spec = dep["metadata"], dep["spec"]
            live = [p for p in self.api.store.list(PODS, meta["namespace"])[0]
                    if _owner_uid(p) == meta["uid"] and not p["metadata"].get("deletionTimestamp")]
            template_hash = _template_hash(spec["template"])
            updated = [p for p in live if p["metadata"].get("labels", {}).get("pod-template-hash") == template_hash]
            ready = sum(_is_ready(p) for p in live)
            desired = spec["replicas"]
            counts = {"observedGeneration": meta["generation"], "replicas": len(live), "updatedReplicas": len(updated),
                      "readyReplicas": ready, "availableReplicas": ready,
                      "unavailableReplicas": max(desired - ready, 0)}
            status = {key: value for key, value in counts.items() if value}  # omitempty, as the API
            max_unavailable = (spec.get("strategy", {}).get("rollingUpdate") or {}).get("maxUnavailable", "25%")
            available = ready >= desired - _scaled(max_unavailable, desired)
            complete = len(updated) == desired == len(live) and ready == desired
            old_conditions = {c["type"]: c for c in (dep.get("status") or {}).get("conditions") or []}
            conditions = []
            for kind_, flag, reason in (
                    ("Available", available, "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable"),
                    ("Progressing", True, "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated")):
                value = "True" if flag else "False"
                old = old_conditions.get(kind_)
                if old is not None and (old["status"], old["reason"]) == (value, reason):
                    conditions.append(old)
                else:
                    conditions.append({"type": kind_, "status": value, "reason": reason, "lastUpdateTime": now(),
                                       "lastTransitionTime": now(), "message": reason})
            status["conditions"] = conditions
            if status != dep.get("status"):
                self.api.update_status(DEPLOYMENTS, meta["namespace"], meta["name"], status, manager=MANAGER)

    def _find_pod(self, name: str, namespace: str | None) -> dict:
        matches = [p for p in self.api.store.list(PODS, namespace)[0] if p["metadata"]["name"] == name]
        if len(matches) != 1:
            raise LookupError(f"{len(matches)} pods named {name!r} (namespace {namespace!r})")
        return matches[0]
