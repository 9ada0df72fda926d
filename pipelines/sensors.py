"""The registry sensor: every endpoint converges to the version its alias names, forward and back.

Each tick drains the webhook inbox (fast path), polls every watched alias every
``poll_interval_s`` (safety net), reads what each endpoint serves (its traffic row) and what
Dagster knows of the deploy runs it asked for, and hands all of it to
:func:`pipelines.deploy_plan.plan_tick`. This module only gathers inputs and turns the plan
into run requests: one run per version wanted, tagged with the endpoints it converges, and
limited to ``served_endpoint`` when the version's checkpoint, gate verdict and cost model
were built under the spec sections the endpoints have now.
"""


import time
from datetime import datetime, timezone

from dagster import (AssetKey, AssetRecordsFilter, DagsterInstance, DagsterRunStatus, DefaultSensorStatus, RunRequest,
                     RunsFilter, SensorEvaluationContext, SensorResult, SkipReason, sensor)

from assets.source_model import model_versions
from controlplane.splits import SplitStore
from controlplane.revisions import RevisionStore, revision_spec
from pipelines.deploy_plan import (GATE_TAG, RUN_KEY_TAG, EndpointView, RunView, SensorCursor, artifact_sections,
                                   lookups_for_tick, plan_tick)
from pipelines.jobs import deploy_job
from pipelines.registry import RegistryError, parse_partition_key, partition_key
from pipelines.reaper import ACTIVE, Owned, orphans
from pipelines.resources import ClusterResource, ControlPlaneResource, RegistryResource

SENSOR_INTERVAL_S = 5
REAPER_INTERVAL_S = 30
IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
             DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
SERVED_ENDPOINT = AssetKey("served_endpoint")


@sensor(
    job=deploy_job,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    description="Converges every endpoint to the version its alias (models:/<model>@<alias>) names.",
)
def registry_sensor(
    context: SensorEvaluationContext, control_plane: ControlPlaneResource, registry: RegistryResource
) -> SensorResult | SkipReason:
    now_s = time.time()
    cursor = SensorCursor.parse(context.cursor)
    inbox = control_plane.inbox()
    pending = inbox.pending()
    store = control_plane.endpoints()
    for name, why in store.invalid():  # reported every tick, never a stop for the other endpoints
        context.log.warning(f"endpoint {name!r} is skipped: its stored spec no longer validates: {why}")
    specs = store.list()
    watched = [(spec.registered_model, spec.alias) for spec in specs]
    lookups = lookups_for_tick(watched, [item.registered_model for item in pending], cursor, now_s)
    client = registry.client()
    try:
        fresh = {f"{model}@{alias}": client.alias_version(model, alias) for model, alias in lookups.pairs}
    except RegistryError as exc:
        return SkipReason(f"registry unavailable, will retry: {exc}")
    resolved = {key: version for key, version in {**cursor.resolved, **fresh}.items()
                if key in {f"{m}@{a}" for m, a in watched}}

    revisions = RevisionStore(control_plane.engine())
    serving, rolled_back = _serving_partitions(revisions), _rolled_back(revisions)
    instance = context.instance
    views = []
    for spec in specs:
        desired = resolved.get(f"{spec.registered_model}@{spec.alias}")
        key = partition_key(spec.registered_model, desired) if desired else None
        views.append(EndpointView(spec.name, spec.registered_model, desired, serving.get(spec.name),
                                  artifact_sections(spec), rolled_back=rolled_back.get((spec.name, key))))
    views = [_with_reuse(instance, view) for view in views]
    known = SensorCursor(cursor.last_poll_s if not lookups.polled else now_s, resolved, cursor.attempts, cursor.serial)
    runs = {key: _run_view(instance, key) for attempt in known.attempts.values() for key in attempt.run_keys[-1:]}
    plan = plan_tick(views, runs, _models_in_flight(instance), known, now_s)

    inbox.mark_processed([item.delivery_id for item in pending])
    for note in plan.notes:
        context.log.warning(note)
    keys = sorted({deploy.partition for deploy in plan.deploys})
    new_keys = [key for key in keys if not instance.has_dynamic_partition(model_versions.name, key)]
    trigger = "webhook" if pending else ("poll" if lookups.polled else "tick")
    requests = [RunRequest(partition_key=deploy.partition, run_key=deploy.run_key,
                           asset_selection=[SERVED_ENDPOINT] if deploy.reuse else None,
                           tags={RUN_KEY_TAG: deploy.run_key, "modelplane/trigger": trigger,
                                 "modelplane/endpoints": ",".join(deploy.endpoints),
                                 "modelplane/reuse": str(deploy.reuse).lower()})
                for deploy in plan.deploys]
    for deploy in plan.deploys:
        context.log.info(f"{', '.join(deploy.endpoints)} → {deploy.partition}"
                         + (" (rollout only: its artifacts fit the spec)" if deploy.reuse else ""))
    return SensorResult(run_requests=requests,
                        dynamic_partitions_requests=[model_versions.build_add_request(new_keys)] if new_keys else [],
                        cursor=plan.cursor.dump())


def _aware(moment: datetime) -> datetime:
    """SQLite gives back naive datetimes; the control plane writes UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def _rolled_back(revisions: RevisionStore) -> dict[tuple[str, str], str]:
    """{(endpoint, partition key): why} for every version the health sensor rolled back on an endpoint."""
    return {(r.endpoint, r.partition_key): str(r.details["rolled_back"]) for r in revisions.list()
            if r.details.get("rolled_back")}


def _serving_partitions(revisions: RevisionStore) -> dict[str, str]:
    """{endpoint: partition key of the revision its traffic goes to}."""
    out = {}
    for endpoint, revision_id in revisions.traffic().items():
        revision = revisions.get(revision_id)
        if revision is not None and revision.partition_key:
            out[endpoint] = revision.partition_key
    return out


def _run_view(instance: DagsterInstance, run_key: str) -> RunView:
    records = instance.get_run_records(RunsFilter(tags={RUN_KEY_TAG: run_key}), limit=1)
    if not records:
        return RunView(None)
    run = records[0].dagster_run
    if run.status in IN_FLIGHT:
        return RunView("in_flight")
    status = "success" if run.status == DagsterRunStatus.SUCCESS else "failure"
    return RunView(status, refused_by_gate=run.tags.get(GATE_TAG) == "refused")


def _models_in_flight(instance: DagsterInstance) -> set[str]:
    models = set()
    for record in instance.get_run_records(RunsFilter(job_name=deploy_job.name, statuses=IN_FLIGHT)):
        partition = record.dagster_run.tags.get("dagster/partition")
        if partition:
            models.add(parse_partition_key(partition)[0])
    return models


def _latest(instance: DagsterInstance, asset: str, partition: str):
    records = instance.fetch_materializations(AssetRecordsFilter(AssetKey(asset), asset_partitions=[partition]),
                                              limit=1).records
    return records[0] if records else None


def _with_reuse(instance: DagsterInstance, view: EndpointView) -> EndpointView:
    """Reusable: the version's checkpoint and cost model exist, the cost model measured that checkpoint
    (so the gate let it through), and both were built under the spec sections the endpoint has now."""
    if view.desired_version is None:
        return view
    partition = f"{view.model}.v{view.desired_version}"
    checkpoint, cost = _latest(instance, "quantized_checkpoint", partition), _latest(instance, "cost_model", partition)
    if checkpoint is None or cost is None or cost.storage_id < checkpoint.storage_id:
        return view
    built = "-".join(str(getattr(record.asset_materialization.metadata.get(key), "value", ""))
                     for record, key in ((checkpoint, "checkpoint_sections"), (cost, "cost_sections")))
    return EndpointView(view.name, view.model, view.desired_version, view.serving_partition, view.sections,
                        reusable=built == view.sections)


@sensor(
    minimum_interval_seconds=REAPER_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    description="Retires revisions that no endpoint routes to and no live run owns (left by runs that died).",
)
def revision_reaper_sensor(context: SensorEvaluationContext, control_plane: ControlPlaneResource,
                           cluster: ClusterResource) -> SkipReason:
    revisions = RevisionStore(control_plane.engine())
    live = {record.dagster_run.run_id for record in context.instance.get_run_records(RunsFilter(statuses=IN_FLIGHT))}
    owned = [Owned(r.id, r.state, r.details.get("run_id"), _aware(r.updated_at or r.created_at))
             for r in revisions.list(states=ACTIVE)]
    splits = SplitStore(control_plane.engine())
    # A canary whose rollout run died mid-phase is not routed to on purpose: its split goes too.
    abandoned = {r.id for r in revisions.list(states=ACTIVE)
                 if r.details.get("canary_phase") and r.details.get("run_id") not in live}
    retired = orphans(owned, splits.routed() - abandoned, live, datetime.now(timezone.utc))
    backend = cluster.client()
    for revision_id in retired:
        splits.forget(revision_id)
        backend.delete(revision_id)
        context.log.warning(f"{revision_id}: no endpoint routes to it and no live run owns it; retired")
    # What a crash left half-made on the backend (Kubernetes: a Deployment without its Service), and
    # anything it runs for a revision that is no longer active.
    converged = backend.converge([revision_spec(r) for r in revisions.list(states=ACTIVE)])
    for change in converged:
        context.log.warning(f"cluster: {change}")
    if retired or converged:
        return SkipReason(f"retired {len(retired)} orphaned revision(s); {len(converged)} cluster change(s)")
    return SkipReason("no orphaned revisions")
