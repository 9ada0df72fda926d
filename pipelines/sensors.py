"""The registry sensor: new model versions behind a watched alias become deploy runs.

Each tick drains the webhook inbox (fast path) and, every ``poll_interval_s``, polls every
alias an endpoint spec watches (safety net). Decisions come from ``pipelines.deploy_plan``;
this module only gathers inputs and turns decisions into Dagster requests. ``run_key`` is
the partition key, so Dagster itself also refuses a second run for one version.
"""


import time

from dagster import DefaultSensorStatus, RunRequest, SensorEvaluationContext, SensorResult, SkipReason, sensor

from assets.source_model import model_versions
from pipelines.deploy_plan import SensorCursor, advance, lookups_for_tick, new_deploys
from pipelines.jobs import deploy_job
from pipelines.registry import RegistryError
from pipelines.resources import ControlPlaneResource, RegistryResource

SENSOR_INTERVAL_S = 5


@sensor(
    job=deploy_job,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    description="Deploys each new model version that a watched alias (models:/<model>@<alias>) points at.",
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
    watched = [(spec.registered_model, spec.alias) for spec in store.list()]
    lookups = lookups_for_tick(watched, [item.registered_model for item in pending], cursor, now_s)

    client = registry.client()
    try:
        resolved = {(model, alias): client.alias_version(model, alias) for model, alias in lookups.pairs}
    except RegistryError as exc:
        return SkipReason(f"registry unavailable, will retry: {exc}")

    keys = new_deploys(resolved, cursor.requested)
    inbox.mark_processed([item.delivery_id for item in pending])
    if keys:
        context.log.info(f"new versions behind watched aliases: {', '.join(keys)}")
    return SensorResult(
        run_requests=[RunRequest(partition_key=key, run_key=key, tags={"modelplane/trigger": _trigger(lookups.polled, pending)}) for key in keys],
        dynamic_partitions_requests=[model_versions.build_add_request(keys)] if keys else [],
        cursor=advance(cursor, lookups, keys, now_s).dump(),
    )


def _trigger(polled: bool, pending: list) -> str:
    if pending:
        return "webhook"
    return "poll" if polled else "none"
