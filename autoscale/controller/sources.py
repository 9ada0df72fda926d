"""Where the controller's inputs come from: the control-plane stores, the routers, the replicas.

- :func:`read_plans`: per serving endpoint, its spec's scaling section, the serving revision,
  its cost profile on this hardware and the newest recorded vertical target;
- :class:`RouterLoad`: every live router's ``GET /internal/in-flight``, summed per endpoint
  and per replica URL (which replicas a scale-down names);
- :class:`ReplicaMetrics`: the replicas' ``/metrics`` (queue depth, KV-cache use).
"""

from __future__ import annotations

import math
from dataclasses import replace
from collections.abc import Mapping

import httpx
from sqlalchemy import Engine

from autoscale.controller.loop import EndpointLoad, EndpointPlan, ReplicaCounts, ReplicaStats
from cluster.protocol import Cluster
from controlplane.cost_profiles import CostProfileStore
from controlplane.revisions import RevisionStore
from controlplane.routers import RouterStore
from controlplane.scaling import ScalingStore
from controlplane.specs import ScalingSignal
from controlplane.store import EndpointStore
from serving.router.cost import RouteCost

PYFUNC_QUEUE = "modelplane_pyfunc_queue_depth"
VLLM_QUEUE = "vllm:num_requests_waiting"
VLLM_KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # newer name first


def read_plans(engine: Engine, hardware_profile: str) -> list[EndpointPlan]:
    revisions, scaling = RevisionStore(engine), ScalingStore(engine)
    profiles = CostProfileStore(engine).for_hardware(hardware_profile)
    traffic = revisions.traffic()
    plans = []
    for spec in EndpointStore(engine).list():
        revision = revisions.get(traffic[spec.name]) if spec.name in traffic else None
        if revision is None:
            continue
        details = revision.details or {}
        profile = profiles.get(revision.partition_key)
        cost = RouteCost.from_profile(profile.model) if profile is not None else None
        signal = spec.scaling.signal
        units = (signal == ScalingSignal.model_units
                 or (signal == ScalingSignal.auto and revision.runtime == "vllm" and cost is not None))
        if units and cost is None:
            units = False  # model_units asked for, but no cost profile yet: requests until one is measured
        fit = details.get("max_replicas_that_fit")
        max_replicas = spec.scaling.max_replicas if not isinstance(fit, int) else max(1, min(spec.scaling.max_replicas, fit))
        target = spec.scaling.target_concurrency or float(details.get("target_concurrency") or 1)
        recorded = scaling.latest(spec.name, "vertical", revision_id=revision.id)
        plans.append(EndpointPlan(
            endpoint=spec.name, revision_id=revision.id, runtime=revision.runtime,
            desired_replicas=revision.desired_replicas, min_replicas=min(spec.scaling.min_replicas, max_replicas),
            max_replicas=max_replicas, target_concurrency=target,
            target_pinned=spec.scaling.target_concurrency is not None,
            sweep_concurrency=tuple(spec.cost_model.concurrency), slo_p99_ms=spec.slo.p99_latency_ms,
            scale_to_zero_grace_s=spec.scaling.scale_to_zero_grace_s,
            unit_cost_ms=(cost.alpha_ms_per_input_token, cost.beta_ms_per_output_token, cost.gamma_ms,
                          cost.concurrency) if units else None,
            reference_tokens=(sorted(spec.cost_model.input_tokens)[len(spec.cost_model.input_tokens) // 2],
                              sorted(spec.cost_model.output_tokens)[len(spec.cost_model.output_tokens) // 2]),
            recorded_target=recorded.target if recorded is not None else None,
            cold_start_s=float(details["cold_start_s"]) if isinstance(details.get("cold_start_s"), (int, float)) else None))
    return plans


def with_desired(plans: list[EndpointPlan], cluster: Cluster) -> list[EndpointPlan]:
    """Each plan with the count its revision is scaled to on the backend now (Kubernetes: the
    Deployment's, which the revisions table does not follow); a revision gone meanwhile drops out."""
    current = []
    for plan in plans:
        try:
            current.append(replace(plan, desired_replicas=cluster.desired_replicas(plan.revision_id)))
        except KeyError:
            continue
    return current


def replica_counts(cluster: Cluster, revision_id: str) -> ReplicaCounts:
    replicas = cluster.replicas(revision_id)
    ready = [r for r in replicas if r.ready]
    starting = [r for r in replicas if not r.ready and r.state in ("starting", "pending")]
    return ReplicaCounts(ready=len(ready), starting=len(starting), urls=tuple(r.url for r in ready),
                         replica_ids_by_url={r.url: r.replica_id for r in replicas})


class RouterLoad:
    """Sums every live router's in-flight snapshot; a router that does not answer counts as silent."""

    def __init__(self, routers: RouterStore, token: str, client: httpx.Client | None = None,
                 log=print) -> None:
        self._routers, self._token, self._log = routers, token, log
        self._client = client or httpx.Client(timeout=2.0)

    def read(self) -> Mapping[str, EndpointLoad]:
        snapshots = []
        for router_id, url in self._routers.live_urls().items():
            try:
                response = self._client.get(f"{url}/internal/in-flight",
                                            headers={"Authorization": f"Bearer {self._token}"})
                response.raise_for_status()
                snapshots.append(response.json())
            except (httpx.HTTPError, ValueError) as exc:
                self._log(f"router {router_id} at {url}: no in-flight snapshot ({exc})")
        return sum_snapshots(snapshots)


def sum_snapshots(snapshots: list[dict]) -> dict[str, EndpointLoad]:
    """Add the routers' current in-flight work per endpoint and per replica; the p99 is the worst router's.

    >>> a = {"endpoints": {"gec": {"in_flight_requests": 3, "in_flight_units": 30.0, "waiting_requests": 0,
    ...                            "p99_latency_ms": 800.0, "requests": 40}}}
    >>> b = {"endpoints": {"gec": {"in_flight_requests": 2, "in_flight_units": 12.5, "waiting_requests": 1,
    ...                            "p99_latency_ms": 950.0, "requests": 10}}}
    >>> sum_snapshots([a, b])["gec"]
    EndpointLoad(in_flight_requests=5.0, in_flight_units=42.5, waiting_requests=1, p99_latency_ms=950.0, requests=50, errors=0)

    Per replica, each router reports the work it sent there (``"replicas"``, by base URL):

    >>> a["endpoints"]["gec"]["replicas"] = {"http://r0": {"in_flight_requests": 3, "in_flight_units": 30.0}}
    >>> b["endpoints"]["gec"]["replicas"] = {"http://r0": {"in_flight_requests": 1, "in_flight_units": 2.5},
    ...                                     "http://r1": {"in_flight_requests": 1, "in_flight_units": 10.0}}
    >>> gec = sum_snapshots([a, b])["gec"]
    >>> gec.in_flight_requests_by_url, gec.in_flight_units_by_url
    ({'http://r0': 4.0, 'http://r1': 1.0}, {'http://r0': 32.5, 'http://r1': 10.0})

    Per revision, answers and errors add up and the p99 is the worst router's:

    >>> a["endpoints"]["gec"]["revisions"] = {"gec-v2": {"p99_latency_ms": 700.0, "requests": 30, "errors": 3}}
    >>> b["endpoints"]["gec"]["revisions"] = {"gec-v2": {"p99_latency_ms": 900.0, "requests": 10, "errors": 0}}
    >>> sum_snapshots([a, b])["gec"].by_revision
    {'gec-v2': (900.0, 40, 3)}
    """
    totals: dict[str, EndpointLoad] = {}
    for snapshot in snapshots:
        for name, load in (snapshot.get("endpoints") or {}).items():
            before = totals.get(name, EndpointLoad())
            p99 = load.get("p99_latency_ms")
            worst = max((v for v in (before.p99_latency_ms, p99) if v is not None), default=None)
            requests_by_url, units_by_url = dict(before.in_flight_requests_by_url), dict(before.in_flight_units_by_url)
            for url, replica in (load.get("replicas") or {}).items():
                requests_by_url[url] = requests_by_url.get(url, 0.0) + float(replica.get("in_flight_requests") or 0)
                units_by_url[url] = units_by_url.get(url, 0.0) + float(replica.get("in_flight_units") or 0)
            by_revision = dict(before.by_revision)
            for revision_id, stats in (load.get("revisions") or {}).items():
                p99_before, answers, errors = by_revision.get(revision_id, (None, 0, 0))
                p99_here = stats.get("p99_latency_ms")
                by_revision[revision_id] = (max((v for v in (p99_before, p99_here) if v is not None), default=None),
                                            answers + int(stats.get("requests") or 0),
                                            errors + int(stats.get("errors") or 0))
            totals[name] = EndpointLoad(before.in_flight_requests + float(load.get("in_flight_requests") or 0),
                                        before.in_flight_units + float(load.get("in_flight_units") or 0),
                                        before.waiting_requests + int(load.get("waiting_requests") or 0),
                                        worst, before.requests + int(load.get("requests") or 0),
                                        before.errors + int(load.get("errors") or 0),
                                        by_revision=by_revision, in_flight_requests_by_url=requests_by_url,
                                        in_flight_units_by_url=units_by_url)
    return totals


class ReplicaMetrics:
    """Queue depth and KV-cache use from the replicas' Prometheus ``/metrics``, and CPU use where a
    reader is given, averaged over the replicas."""

    def __init__(self, client: httpx.Client | None = None, cpu=None) -> None:
        self._client = client or httpx.Client(timeout=2.0)
        self._cpu = cpu  # local backend: autoscale.controller.local_cpu.LocalCpu (None: not read)

    def read(self, replica_urls: list[str], runtime: str) -> ReplicaStats:
        queues, kv = [], []
        for url in replica_urls:
            try:
                text = self._client.get(f"{url}/metrics").text
            except httpx.HTTPError:
                continue
            values = parse_gauges(text)
            queues.append(values.get(VLLM_QUEUE if runtime == "vllm" else PYFUNC_QUEUE, 0.0))
            kv_value = next((values[name] for name in VLLM_KV_CACHE if name in values), None)
            if kv_value is not None:
                kv.append(kv_value)
        cpu = self._cpu.mean_utilization(replica_urls) if self._cpu is not None else None
        return ReplicaStats(queue_depth=sum(queues) / len(queues) if queues else 0.0, cpu_utilization=cpu,
                            kv_cache_utilization=sum(kv) / len(kv) if kv else None)


def parse_gauges(text: str) -> dict[str, float]:
    """Sum of each metric's samples in Prometheus text format (labels folded together).

    >>> parse_gauges('# HELP x\\nvllm:num_requests_waiting{model_name="m"} 3.0\\nother 1\\nbad line x\\n')
    {'vllm:num_requests_waiting': 3.0, 'other': 1.0}
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:  # label values may hold spaces: the value follows the closing brace
            name, rest = line[:line.index("{")], line[line.rindex("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            values[name] = values.get(name, 0.0) + value
    return values


def router_loads(engine) -> dict[str, EndpointLoad]:
    """Every live router's last 30 s, summed, read with an admin token that lives for this call only
    (the health sensor and a rollout's canary phase read it)."""
    from controlplane.tokens import TokenStore

    tokens = TokenStore(engine)
    token_id, token = tokens.create([], admin=True, description="router load (one read)")
    try:
        return dict(RouterLoad(RouterStore(engine), token, log=lambda _m: None).read())
    finally:
        tokens.revoke(token_id)
