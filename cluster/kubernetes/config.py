"""How the Kubernetes backend runs replicas: the namespace, the images, the defaults of a pod.

Everything here is per install (``controlplane.settings``: ``MODELPLANE_CLUSTER=kubernetes`` and
the ``MODELPLANE_K8S_*`` variables); what differs per endpoint (CPU, memory, GPUs, workers)
comes from the endpoint spec's ``replica`` options.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from serving.runtime.liveness import LivenessConfig

#: The label every object the backend creates carries; lists and watches select on it.
MANAGED_BY = {"app.kubernetes.io/managed-by": "modelplane"}
ENDPOINT_LABEL = "modelplane.io/endpoint"
REVISION_LABEL = "modelplane.io/revision"  # the object name: a revision id may be longer than a label value
REVISION_ANNOTATION = "modelplane.io/revision-id"  # the revision id itself
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"  # the ReplicaSet controller's victim order
FIELD_MANAGER = "modelplane"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class KubernetesConfig:
    namespace: str = "modelplane"
    # The platform image (deploy/Dockerfile): Python, the locked dependencies and modelplane. Replica
    # pods run it; the model comes from the revision's serving image (an image volume) or from
    # the shared models volume.
    runtime_image: str = "modelplane:latest"
    # A ReadWriteMany PersistentVolumeClaim holding MODELPLANE_HOME (models, checkpoints), mounted at
    # home_path in every replica pod that has no serving image; None: such revisions are refused.
    models_claim: str | None = "modelplane-home"
    home_path: str = "/var/lib/modelplane"
    port: int = 8000  # the runtime's port inside the pod
    service_account: str = "modelplane-replica"  # replica pods' identity (deploy/ ships it with no Role, no token)
    default_cpu_cores: float = 2.0  # per replica, when the spec does not say
    default_memory_gib: float = 8.0
    startup_default_s: float = 900.0  # how long a replica may take to start when no start was measured
    startup_factor: float = 3.0  # × the measured time to ready, for the startupProbe's budget
    startup_min_s: float = 120.0
    termination_grace_s: int = 120  # preStop drain + the server's own graceful shutdown
    drain_settle_s: float = 5.0  # preStop: wait for routers to see the endpoint go, before draining
    probe_period_s: int = 10  # liveness (forward progress) look interval
    watch_timeout_s: int = 300  # each EndpointSlice watch request ends after this and is renewed (as client-go's)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)  # MODELPLANE_LIVENESS_*: the probe's thresholds

    def __post_init__(self) -> None:
        problems = []
        if not _DNS_LABEL.match(self.namespace) or len(self.namespace) > 63:
            problems.append(f"namespace {self.namespace!r} is not a DNS label (lowercase letters, digits, '-')")
        if not self.runtime_image.strip():
            problems.append("runtime_image is empty")
        if not self.home_path.startswith("/"):
            problems.append(f"home_path {self.home_path!r} must be absolute")
        if not 0 < self.port < 65536:
            problems.append(f"port {self.port} is not a TCP port")
        for name in ("default_cpu_cores", "default_memory_gib", "startup_default_s", "startup_factor",
                     "startup_min_s", "probe_period_s", "watch_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.termination_grace_s <= self.drain_settle_s:
            problems.append("termination_grace_s must exceed drain_settle_s")
        if problems:
            raise ValueError("invalid Kubernetes backend config: " + "; ".join(problems))
