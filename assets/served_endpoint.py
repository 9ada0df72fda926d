"""``served_endpoint``: the version live behind the router, for every endpoint that serves it.

It serves the checkpoint the ``eval_gate`` verdict names (:mod:`assets.gate_verdict`): the
quantized candidate that passed, the unquantized baseline where the gate refused the first
candidate of an endpoint and ``eval_gate.on_failure`` is ``serve_baseline``, the source files
for classic models and ``scheme: none``. It runs once ``cost_model`` measured that checkpoint
on this hardware (the router prices its requests
with that profile; the starting target concurrency is recorded with the revision).

For each endpoint spec whose alias still points at this version: create a revision, start
its replicas on the cluster backend, wait until every replica is ready, move the
endpoint's traffic to it, drain the previous revision and retire it (:mod:`assets.rollout`
decides; :class:`RolloutDriver` acts). A revision that never becomes ready is retired and
the endpoint keeps serving the one it had. ``min_replicas`` that do not fit where replicas run
are refused before anything starts (:mod:`cluster.capacity`; ``cost_model`` checks the same
before its benchmark replica starts). The version's MLflow page says
where and since when it serves, or why it does not, and so does the page of a version it
replaced (``modelplane.serving.*`` tags, :mod:`assets.serving_state`).
"""

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx
from dagster import AssetExecutionContext, Failure, MetadataValue, Output, asset

from assets.catalog import GROUP, OWNERS, step_tags
from assets.gate_verdict import serving_checkpoint
from assets.metadata import endpoints_table, links, mlflow_version_url
from assets.serving_specs import serving_specs
from assets.serving_state import record_serving, scaling_plot
from assets.canary import CanaryPhase
from assets.rollout import (Canary, CanaryPlan, CanaryVerdict, Drain, Retire, RolloutResult, Route, Start, StillCurrent,
                            Superseded, WaitReady, rollout)
from assets.source_model import DEPLOY_RETRIES, model_versions
from cluster.capacity import Capacity, CapacityError, check_min_replicas, model_bytes, replica_memory_bytes
from cluster.protocol import Cluster, Replica
from images.ref import ImageRef
from autoscale.controller.sources import router_loads
from controlplane.revisions import RevisionStore, TrafficChanged, revision_spec
from controlplane.routers import RouterStore
from controlplane.splits import SplitStore
from controlplane.specs import Runtime
from pipelines.registry import RegistryError, parse_partition_key
from pipelines.resources import ClusterResource, ControlPlaneResource, RegistryResource
from serving.runtime.model_layout import locate
from serving.runtime.registry import runtime_for
from serving.tls import tls_context

CRASH_LOOP_RESTARTS = 3


def choose_runtime(requested: Runtime, is_llm: bool) -> str:
    """``auto`` follows the model: LLMs (transformers flavor) on vLLM, the rest on pyfunc."""
    if requested is Runtime.auto:
        return "vllm" if is_llm else "pyfunc"
    if requested is Runtime.vllm and not is_llm:
        raise Failure(description="runtime: vllm was requested for a model that is not an LLM (transformers flavor)")
    return requested.value


@dataclass
class RolloutDriver:
    cluster: Cluster
    revisions: RevisionStore
    log: Callable[[str], None]
    wait_ready_timeout_s: float = 900.0
    drain_timeout_s: float = 120.0
    poll_s: float = 0.5
    still_current: Callable[[str], bool] = lambda _endpoint: True  # noqa: E731 - endpoint → alias unchanged?
    # Who must have seen a traffic switch before the replaced revision drains (None: no router,
    # e.g. a cost sweep, whose revision no endpoint routes to).
    routers: RouterStore | None = None
    routers_timeout_s: float = 30.0
    # Runs a canary phase (assets.canary.CanaryPhase); None: a Canary action is refused.
    canary: Callable[[Canary], CanaryVerdict] | None = None
    # Why the last WaitReady failed, in words, with the replica's own reason where the backend
    # knows it (Replica.last_error): for the step's failure message.
    not_ready: str = ""
    crash_loop: bool = False  # it failed as a replica restarting without ever being ready: retrying repeats it
    _routed_at: datetime | None = None

    def run(self, flow: Generator) -> RolloutResult:
        result = None
        try:
            action = flow.send(None)
            while True:
                result = self.act(action)
                action = flow.send(result)
        except StopIteration as stop:
            return stop.value

    def act(self, action):
        if isinstance(action, Start):
            revision = self.revisions.get(action.revision_id)
            self.cluster.apply(revision_spec(revision, action.replicas))
            self.log(f"{revision.id}: starting {action.replicas} {revision.runtime} replica(s)")
            return None
        if isinstance(action, WaitReady):
            return self.wait_ready(action)
        if isinstance(action, StillCurrent):
            return self.still_current(action.endpoint)
        if isinstance(action, Canary):
            if self.canary is None:
                return CanaryVerdict(False, "this driver cannot run a canary phase")
            return self.canary(action)
        if isinstance(action, Route):
            try:
                previous = self.revisions.route(action.endpoint, action.revision_id, action.expected_previous)
            except TrafficChanged as changed:
                self.log(f"{action.endpoint}: traffic moved to {changed.current} during this rollout")
                return Superseded(changed.current)
            self._routed_at = datetime.now(timezone.utc)
            self.revisions.set_state(action.revision_id, "serving")
            # when its bake began, and what a rollback would return to (pipelines.health)
            self.revisions.add_details(action.revision_id, routed_at=self._routed_at.isoformat(), replaced=previous)
            self.log(f"{action.endpoint}: traffic → {action.revision_id}" + (f" (was {previous})" if previous else ""))
            return previous
        if isinstance(action, Drain):
            self._drain(action.revision_id)
            return None
        if isinstance(action, Retire):
            revision = self.revisions.get(action.revision_id)
            self.cluster.delete(action.revision_id)
            self.revisions.set_state(action.revision_id, "retired" if revision.state != "pending" else "failed")
            self.log(f"{action.revision_id}: retired")
            return None
        raise TypeError(f"unknown rollout action {action!r}")

    def wait_ready(self, action: WaitReady) -> bool:
        started = time.monotonic()
        deadline = started + self.wait_ready_timeout_s
        while time.monotonic() < deadline:
            replicas = self.cluster.replicas(action.revision_id)
            if sum(r.ready for r in replicas) >= action.replicas:
                self.revisions.set_state(action.revision_id, "ready")
                # the measured cold start: how far ahead the autoscaler must look, how long the router holds
                self.revisions.add_details(action.revision_id, cold_start_s=round(time.monotonic() - started, 1))
                return True
            looping = [r for r in replicas if r.restarts >= CRASH_LOOP_RESTARTS]
            if looping:
                self.crash_loop = True
                return self._not_ready(f"replica {looping[0].replica_id} restarted {looping[0].restarts} times "
                                       "without becoming ready", looping[0])
            time.sleep(self.poll_s)
        failed = [r for r in self.cluster.replicas(action.revision_id) if r.last_error]
        return self._not_ready(f"not ready after {self.wait_ready_timeout_s:.0f} s", failed[0] if failed else None)

    def _not_ready(self, what: str, replica: Replica | None) -> bool:
        reason = replica.last_error if replica is not None else None
        where = "(its log: $MODELPLANE_HOME/logs/replicas/, or the pod's)"
        self.not_ready = f"{what}: {reason}" if reason else f"{what} {where}"
        self.log(self.not_ready)
        return False

    def _wait_for_routers(self) -> None:
        """Until every live router serves a table read after the traffic switch: from then on
        none sends the replaced revision a new request."""
        if self.routers is None or self._routed_at is None:
            return
        deadline = time.monotonic() + self.routers_timeout_s
        while (lagging := self.routers.lagging(self._routed_at)) and time.monotonic() < deadline:
            time.sleep(self.poll_s)
        if lagging:
            self.log(f"routers {', '.join(lagging)} still serve a table from before the switch after "
                     f"{self.routers_timeout_s:.0f} s; draining anyway")

    def _drain(self, revision_id: str) -> None:
        """Once no router routes to it any more, wait until the old revision has nothing in flight
        (or the drain timeout)."""
        self.revisions.set_state(revision_id, "draining")
        revision = self.revisions.get(revision_id)
        self._wait_for_routers()
        runtime = runtime_for(revision.runtime)
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline:
            busy = 0.0
            for replica in self.cluster.replicas(revision_id):
                try:
                    progress = runtime.progress(httpx.get(f"{replica.url}/metrics", timeout=2, verify=tls_context()).text)
                    busy += progress.in_flight + progress.queued
                except httpx.HTTPError:
                    continue
            if busy == 0:
                return
            time.sleep(self.poll_s)
        self.log(f"{revision_id}: still busy after {self.drain_timeout_s:.0f} s of draining; retiring it anyway")


def cold_start_metadata(cold_start: dict | None) -> dict:
    """The first replica's cold start, split (the supervisor measured it), as Dagster metadata.

    >>> cold_start_metadata({"time_to_ready_s": 9.5, "image_s": 1.0, "weights_s": 0.5, "engine_s": 8.0,
    ...                      "bytes_before_ready": 1000, "image_bytes": 4000, "mount": "kernel"})["cold_start_engine_s"]
    8.0
    """
    if not cold_start:
        return {}
    return {f"cold_start_{key}": value for key, value in cold_start.items() if value is not None}


def canary_plan(spec) -> CanaryPlan | None:
    """The spec's canary phase (None: switch at once)."""
    if spec.rollout.canary_percent <= 0:
        return None
    return CanaryPlan(spec.rollout.canary_percent, spec.rollout.canary_duration_s, spec.slo.p99_latency_ms,
                      spec.rollout.canary_max_error_increase, spec.rollout.canary_max_p99_ratio)


def _roll_out(driver: RolloutDriver, revisions: RevisionStore, endpoint: str, revision_id: str, replicas: int,
              current: str | None, canary: CanaryPlan | None = None) -> RolloutResult:
    """Drive one rollout; if the run is terminated (or anything raises) before the new revision
    took the traffic, retire it on the way out: no replica is left running for nothing."""
    try:
        return driver.run(rollout(endpoint, revision_id, replicas, expected_previous=current, canary=canary))
    except BaseException:
        if revisions.traffic().get(endpoint) != revision_id:
            driver.act(Retire(revision_id))
        raise


def replicas_that_fit(spec, runtime: str, model_dir: str, replicas: int, capacity: Capacity) -> int:
    """How many of this endpoint's replicas fit; a Failure (not retried) when ``replicas`` do not."""
    try:
        per_replica = replica_memory_bytes(runtime, model_bytes(Path(model_dir)), spec.replica.model_dump())
        return check_min_replicas(spec.name, replicas, per_replica, capacity)
    except CapacityError as exc:
        raise Failure(description=str(exc), allow_retries=False) from None


def _record_replaced(client, revisions: RevisionStore, router_url: str, partition_key: str, served: list) -> None:
    """The versions this rollout took endpoints from: their MLflow pages say by what and when."""
    for entry in served:
        previous = revisions.get(entry["previous_revision"]) if entry["previous_revision"] else None
        if previous is not None and previous.partition_key != partition_key:
            at = revisions.get(entry["revision"]).details.get("routed_at", "")
            try:
                record_serving(client, revisions, router_url, previous.partition_key,
                               f"replaced by {partition_key} on {entry['endpoint']} at {at}")
            except KeyError:  # that version was deleted from the registry since; nothing to tag
                continue


@asset(
    partitions_def=model_versions,
    group_name=GROUP,
    kinds={"python", "mlflow"},
    owners=OWNERS,
    tags=step_tags(5, "serve", changes_traffic=True),
    description="Step 5 of 5. The version live behind the router for every endpoint whose alias points at it: "
                "a new revision started, made ready, given the traffic, the old one drained and retired. Shows "
                "the endpoint URL, the revisions, the cold start and, once the autoscaler has decided, replicas "
                "against demand over the last day; writes where the version serves on its MLflow page.",
    retry_policy=DEPLOY_RETRIES,
)
def served_endpoint(
    context: AssetExecutionContext,
    quantized_checkpoint: dict,
    cost_model: dict,
    serving_image: dict,
    control_plane: ControlPlaneResource,
    registry: RegistryResource,
    cluster: ClusterResource,
) -> Output[list]:
    model, version = parse_partition_key(context.partition_key)
    client = registry.client()
    specs, superseded = serving_specs(control_plane.endpoints().list(), model, version, client.alias_version)
    revisions = RevisionStore(control_plane.engine())

    def stop(reason: str, allow_retries: bool = True) -> Failure:
        """The run stops here: the version's MLflow page says why, unless it serves elsewhere already."""
        try:
            record_serving(client, revisions, control_plane.router_url, context.partition_key, reason)
        except (RegistryError, KeyError) as exc:  # the failure to report is the rollout's, not this
            context.log.warning(f"could not write why {model} v{version} does not serve on its MLflow page: {exc}")
        return Failure(description=reason, allow_retries=allow_retries)

    if not specs:
        names = ", ".join(s.name for s in superseded)
        raise stop(f"no endpoint serves {model} v{version} now"
                   + (f" (the aliases of {names} point elsewhere)" if names else
                      f"; create a spec with model: models:/{model}@<alias>"), allow_retries=False)
    aliases = {spec.name: spec.alias for spec in specs}
    engine = control_plane.engine()
    driver = RolloutDriver(cluster.client(), revisions, context.log.info, routers=RouterStore(engine),
                           still_current=lambda endpoint: client.alias_version(model, aliases[endpoint]) == version,
                           canary=CanaryPhase(SplitStore(engine), lambda: router_loads(engine), context.log.info,
                                              revisions=revisions, routers=RouterStore(engine)))
    checkpoint = serving_checkpoint(quantized_checkpoint)
    profile = cluster.hardware_profile()
    capacity = cluster.capacity()
    details = {"checkpoint": checkpoint.label, "quantized": checkpoint.quantized, "eval_gate": checkpoint.gate,
               "eval_gate_reasons": list(checkpoint.reasons), "hardware_profile": profile.key, "cpu_amx": profile.amx,
               "target_concurrency": cost_model["target_concurrency"], "run_id": context.run_id}
    if quantized_checkpoint["is_llm"]:  # the router bounds max_tokens by it
        details["context_tokens"] = locate(Path(checkpoint.model_dir)).context_tokens
    if checkpoint.reasons:
        context.log.warning(f"{model} v{version}: {checkpoint.gate}")
    served = []
    for spec in specs:
        runtime = choose_runtime(spec.runtime, quantized_checkpoint["is_llm"])
        replicas = max(1, spec.scaling.min_replicas)
        fit = replicas_that_fit(spec, runtime, checkpoint.model_dir, replicas, capacity)
        if spec.scaling.max_replicas > fit:
            context.log.warning(f"{spec.name}: scaling.max_replicas is {spec.scaling.max_replicas} but "
                                f"{capacity.where} holds {fit} such replicas; the autoscaler stops at {fit}")

        def serving_this_version(routed: str | None) -> dict | None:
            """The endpoint's entry when the revision its traffic is ``routed`` to is one of this version."""
            routed_revision = revisions.get(routed) if routed else None
            if routed_revision is None or routed_revision.partition_key != context.partition_key:
                return None
            return {"endpoint": spec.name, "revision": routed, "previous_revision": None, "runtime": runtime,
                    "replicas": routed_revision.desired_replicas, "checkpoint": checkpoint.label,
                    "target_concurrency": cost_model["target_concurrency"], "time_to_ready_s": 0.0,
                    "url": f"{control_plane.router_url}/serving-endpoints/{spec.name}/invocations"}

        current = revisions.traffic().get(spec.name)
        if (already := serving_this_version(current)) is not None:
            context.log.info(f"{spec.name}: already serves {context.partition_key} ({already['revision']})")
            served.append(already)
            continue
        image = serving_image.get("images", {}).get(runtime)  # None: replicas start in place
        revision = revisions.create(spec.name, context.partition_key, checkpoint.model_dir, runtime,
                                    spec.replica.model_dump(), replicas,
                                    details | {"max_replicas_that_fit": fit,
                                               "expected_start_s": cost_model.get("replica_start_s")},
                                    image=image)
        started = time.monotonic()
        result = _roll_out(driver, revisions, spec.name, revision.id, replicas, current, canary_plan(spec))
        if result.superseded:
            context.log.warning(f"{spec.name}: {result.reason}")
            # Another run of this same version (a webhook and the sensor both asked for it) routed
            # first: the endpoint serves what this run was for, so this run has not failed.
            if (already := serving_this_version(revisions.traffic().get(spec.name))) is not None:
                served.append(already)
            continue
        if not result.ok:
            raise stop(f"{spec.name}: {result.reason}" + (f"; {driver.not_ready}" if driver.not_ready else ""),
                       allow_retries=not driver.crash_loop)
        served.append({"endpoint": spec.name, "revision": revision.id, "previous_revision": result.previous_revision_id,
                       "runtime": runtime, "replicas": replicas, "checkpoint": checkpoint.label,
                       "target_concurrency": cost_model["target_concurrency"], "time_to_ready_s": round(time.monotonic() - started, 1),
                       "url": f"{control_plane.router_url}/serving-endpoints/{spec.name}/invocations",
                       "image": ImageRef.from_json(image).reference if image else None,
                       "cold_start": revisions.get(revision.id).details.get("cold_start")})
    if not served:
        raise stop(f"every endpoint's alias moved past {model} v{version} during the rollout; nothing changed",
                   allow_retries=False)
    record_serving(client, revisions, control_plane.router_url, context.partition_key,
                   "its endpoints moved to other versions while this run rolled it out")
    _record_replaced(client, revisions, control_plane.router_url, context.partition_key, served)
    first = served[0]
    return Output(served, metadata={
        "url": MetadataValue.url(first["url"]),
        "revision": first["revision"],
        "previous_revision": first["previous_revision"] or "",
        "runtime": first["runtime"],
        "checkpoint": first["checkpoint"],
        "eval_gate": checkpoint.gate,
        **({"eval_gate_reasons": MetadataValue.md("\n".join(f"- {r}" for r in checkpoint.reasons))}
           if checkpoint.reasons else {}),
        "hardware_profile": profile.key,
        "cpu_amx": profile.amx,
        "target_concurrency": first["target_concurrency"],
        "replicas": first["replicas"],
        "time_to_ready_s": first["time_to_ready_s"],
        "started_from": first.get("image") or "the model directory, in place",
        **cold_start_metadata(first.get("cold_start")),
        "endpoints": MetadataValue.json(served),
        "endpoints_table": MetadataValue.md(endpoints_table(served)),
        "replicas_vs_demand": scaling_plot(engine, first["endpoint"], first["target_concurrency"]),
        **links(mlflow_version=mlflow_version_url(registry.web_url(), model, version)),
    })
