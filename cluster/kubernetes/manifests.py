"""The objects of one revision: a Deployment, its Service and its PodDisruptionBudget (pure).

Each carries the ``app.kubernetes.io/managed-by: modelplane`` label, the endpoint and the
revision (the object name, as a label) and the revision id (an annotation: ids may be longer
than a label value), so that a revision's objects are found, and deleted, together. The
Service and the PodDisruptionBudget are owned by the Deployment (``ownerReferences``), so
the garbage collector removes them with it even if modelplane does not.

The pod runs the platform image (``KubernetesConfig.runtime_image``) with the model from the
revision's serving image, mounted as an image volume, or from the shared models volume. It
starts through ``serving.runtime.launch``, which sizes the engine (threads, KV cache) inside
the pod from its cgroup limits, as the local backend sizes it from this machine's cgroup;
``OMP_NUM_THREADS`` is also set here from the CPU limit.

Probes: a startupProbe whose budget comes from the measured time to ready; readiness on
``/health`` (the model loaded); liveness on forward progress (``cluster.kubernetes.probes
live``: the counters in ``/metrics`` move, else a one-token probe request, as the supervisor
judges local replicas); a preStop hook that waits for routers to drop the endpoint and then
for the requests in flight to finish.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from pathlib import PurePosixPath

from cluster.kubernetes.config import (ENDPOINT_LABEL, MANAGED_BY, REVISION_ANNOTATION, REVISION_LABEL,
                                       KubernetesConfig)
from cluster.protocol import RevisionSpec

IMAGE_MOUNT = "/opt/modelplane-image"  # where the serving image's root is mounted in the pod
STATE_DIR = "/tmp/modelplane"  # the liveness probe's state (an emptyDir)


def object_name(revision_id: str) -> str:
    """A DNS-1123 label for a revision id: lowercase, ``-`` for anything else, a hash when cut or changed.

    >>> object_name("gec-v3-ab12")
    'mp-gec-v3-ab12'
    >>> object_name("Tiny_LLM-v2")
    'mp-tiny-llm-v2-9fe14541'
    >>> len(object_name("x" * 200))
    63
    """
    cleaned = re.sub(r"[^a-z0-9-]+", "-", revision_id.lower()).strip("-") or "revision"
    name = f"mp-{cleaned}"
    if name != f"mp-{revision_id}" or len(name) > 63:
        digest = hashlib.sha256(revision_id.encode()).hexdigest()[:8]
        name = f"{name[:63 - 9].rstrip('-')}-{digest}"
    return name


def labels(spec: RevisionSpec) -> dict[str, str]:
    return {**MANAGED_BY, "app.kubernetes.io/name": "modelplane-replica", ENDPOINT_LABEL: spec.endpoint,
            REVISION_LABEL: object_name(spec.revision_id)}


def startup_budget_s(expected_start_s: float | None, config: KubernetesConfig) -> float:
    """How long the startupProbe lets a replica start: a multiple of the measured time to ready.

    >>> startup_budget_s(None, KubernetesConfig())
    900.0
    >>> startup_budget_s(20.0, KubernetesConfig()), startup_budget_s(100.0, KubernetesConfig())
    (120.0, 300.0)
    """
    if expected_start_s is None:
        return config.startup_default_s
    return max(config.startup_min_s, config.startup_factor * expected_start_s)


def resources(runtime_config: dict, config: KubernetesConfig) -> dict:
    """Requests equal to limits (a Guaranteed pod: its cores are its own, so its threads are too).

    >>> resources({"cpu_cores": 1.5, "gpus": 1}, KubernetesConfig())["limits"]
    {'cpu': '1500m', 'memory': '8192Mi', 'nvidia.com/gpu': '1'}
    """
    cpu = float(runtime_config.get("cpu_cores") or config.default_cpu_cores)
    memory_gib = float(runtime_config.get("memory_gib") or config.default_memory_gib)
    limits = {"cpu": f"{round(cpu * 1000)}m", "memory": f"{math.ceil(memory_gib * 1024)}Mi"}
    gpus = int(runtime_config.get("gpus") or 0)
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(limits), "limits": limits}


def model_dir_in_pod(spec: RevisionSpec, config: KubernetesConfig) -> str:
    """The model's path inside the pod; ValueError when the pod could not reach it."""
    if spec.image is not None:
        model_path = next(layer["path"] for layer in spec.image["layers"] if layer["role"] == "model")
        return str(PurePosixPath(IMAGE_MOUNT) / model_path)
    home = PurePosixPath(config.home_path)
    model_dir = PurePosixPath(spec.model_dir)
    if config.models_claim is None or not model_dir.is_relative_to(home):
        raise ValueError(f"{spec.revision_id}: on Kubernetes a replica reads its model from its serving image or from "
                         f"the shared models volume at {home} (MODELPLANE_K8S_MODELS_CLAIM); {spec.model_dir} is "
                         "neither: turn serving images on (MODELPLANE_IMAGES=lazy) or keep MODELPLANE_HOME on that volume")
    return str(model_dir)


def deployment(spec: RevisionSpec, config: KubernetesConfig) -> dict:
    selector = {REVISION_LABEL: object_name(spec.revision_id)}
    model_dir = model_dir_in_pod(spec, config)
    limits = resources(spec.runtime_config, config)
    threads = max(1, math.floor(float(spec.runtime_config.get("cpu_cores") or config.default_cpu_cores)))
    python = ["python", "-m"]
    probe_args = ["--runtime", spec.runtime, "--port", str(config.port), "--model-dir", model_dir,
                  "--model-name", spec.endpoint]
    period = 5
    container = {
        "name": "runtime",
        "image": config.runtime_image,
        "imagePullPolicy": "IfNotPresent",
        "command": [*python, "serving.runtime.launch", *probe_args, "--host", "0.0.0.0",
                    "--config-json", json.dumps(spec.runtime_config, sort_keys=True)],
        "ports": [{"name": "http", "containerPort": config.port, "protocol": "TCP"}],
        "env": [{"name": "OMP_NUM_THREADS", "value": str(threads)}, {"name": "HOME", "value": STATE_DIR},
                {"name": "MODELPLANE_REVISION", "value": spec.revision_id}],
        "resources": limits,
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": period,
                         "failureThreshold": math.ceil(startup_budget_s(spec.expected_start_s, config) / period)},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2,
                           "failureThreshold": 2},
        "livenessProbe": {"exec": {"command": [*python, "cluster.kubernetes.probes", "live", *probe_args,
                                               "--state", f"{STATE_DIR}/liveness.json",
                                               "--probe-timeout-s", str(max(1, config.probe_period_s - 2)),
                                               "--liveness", json.dumps(dataclasses.asdict(config.liveness))]},
                          "periodSeconds": config.probe_period_s, "timeoutSeconds": config.probe_period_s,
                          "failureThreshold": 1},
        "lifecycle": {"preStop": {"exec": {"command": [
            *python, "cluster.kubernetes.probes", "drain", "--runtime", spec.runtime, "--port", str(config.port),
            "--settle-s", f"{config.drain_settle_s:g}", "--timeout-s", str(config.termination_grace_s - 10)]}}},
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "state", "mountPath": STATE_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
    }
    volumes: list[dict] = [{"name": "state", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    if spec.image is not None:
        reference = f"{spec.image['registry'].split('://', 1)[-1]}/{spec.image['repo']}@{spec.image['manifest_digest']}"
        volumes.append({"name": "serving-image", "image": {"reference": reference, "pullPolicy": "IfNotPresent"}})
        container["volumeMounts"].append({"name": "serving-image", "mountPath": IMAGE_MOUNT, "readOnly": True})
    else:
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": config.models_claim,
                                                                    "readOnly": True}})
        container["volumeMounts"].append({"name": "models", "mountPath": config.home_path, "readOnly": True})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(spec, config),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels(spec), "annotations": {REVISION_ANNOTATION: spec.revision_id}},
                "spec": {
                    "containers": [container],
                    "volumes": volumes,
                    "terminationGracePeriodSeconds": config.termination_grace_s,
                    "serviceAccountName": config.service_account,
                    "automountServiceAccountToken": False,  # a replica never calls the Kubernetes API
                    "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                },
            },
        },
    }


def service(spec: RevisionSpec, config: KubernetesConfig, owner: dict | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec, config, owner),
        "spec": {"selector": {REVISION_LABEL: object_name(spec.revision_id)},
                 "ports": [{"name": "http", "port": config.port, "targetPort": "http", "protocol": "TCP"}],
                 "publishNotReadyAddresses": False},
    }


def disruption_budget(spec: RevisionSpec, config: KubernetesConfig, owner: dict | None = None) -> dict:
    """At most one replica of the revision evicted at a time (a node drain waits for the next to be ready)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(spec, config, owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {REVISION_LABEL: object_name(spec.revision_id)}}},
    }


def owner_reference(deployment_object: dict) -> dict:
    """What the Service and the PodDisruptionBudget point at: the live Deployment (its uid)."""
    meta = deployment_object["metadata"]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def revision_objects(spec: RevisionSpec, config: KubernetesConfig,
                     owner_uid: str = "00000000-0000-0000-0000-000000000000") -> list[dict]:
    """All three, as the backend applies them (``owner_uid``: the Deployment's, once it exists)."""
    owned_by = owner_reference({"metadata": {"name": object_name(spec.revision_id), "uid": owner_uid}})
    return [deployment(spec, config), service(spec, config, owned_by),
            disruption_budget(spec, config, owned_by)]


def _metadata(spec: RevisionSpec, config: KubernetesConfig, owner: dict | None = None) -> dict:
    meta = {"name": object_name(spec.revision_id), "namespace": config.namespace, "labels": labels(spec),
            "annotations": {REVISION_ANNOTATION: spec.revision_id}}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta
