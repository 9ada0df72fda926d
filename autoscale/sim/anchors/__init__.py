"""Other systems' autoscalers at their documented defaults, each a :class:`ScalingPolicy`.

The day model runs them against the same demand as modelplane's own policy. Each takes the
per-replica concurrency target (requests in flight), the replica bounds and the count the
fleet starts with, plus keyword settings whose defaults are the system's own, read in its
source (the class docstrings cite file and version):

- ``static_peak``: the peak's replica count, all day;
- ``hpa``: Kubernetes' HorizontalPodAutoscaler on a pods metric (in flight per pod);
- ``knative_kpa``: Knative Serving's KPA, stable and panic windows on concurrency;
- ``ray_serve``: Ray Serve's default policy, ongoing requests with up/down delays;
- ``aibrix_kpa``: AIBrix's KPA, a Knative port with its own defaults and differences.

Shared conventions. Each policy reads ``view.in_flight`` on every call (one simulated second)
and decides on its system's cadence, returning its last order in between. A ceiling ignores
1e-9 of float noise (8.000000001 in flight at 4 per replica is 2 replicas), as the systems'
fixed-point or rounded metrics do. Every result lies in ``[min_replicas, max_replicas]``.
"""

from autoscale.sim.anchors.aibrix import AIBrixKPA, aibrix_cooldown
from autoscale.sim.anchors.base import StaticPeak, rate_bounds, view_at
from autoscale.sim.anchors.hpa import KubernetesHPA, pods_metric_replicas
from autoscale.sim.anchors.knative import KnativeKPA
from autoscale.sim.anchors.ray import RAY_SERVE_DEFAULT_TARGET_ONGOING_REQUESTS, RayServe

__all__ = ["AIBrixKPA", "KnativeKPA", "KubernetesHPA", "RAY_SERVE_DEFAULT_TARGET_ONGOING_REQUESTS", "RayServe",
           "StaticPeak", "aibrix_cooldown", "pods_metric_replicas", "rate_bounds", "view_at"]
