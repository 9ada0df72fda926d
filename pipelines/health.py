"""Served endpoints kept healthy from Dagster: the ``endpoint_health`` check, its sensor, the rollback job.

Every 30 s the health sensor gathers, for each endpoint with a serving revision, what the
routers saw over their last 30 s (``GET /internal/in-flight``, read with an admin token the
tick creates and revokes), the replicas ready against desired, and the heartbeats of the
routers and the autoscaler; :func:`assets.endpoint_health.assess` decides. The verdict is an
``endpoint_health`` check evaluation on the ``served_endpoint`` partition of the serving
version (visible in the Dagster UI, severity WARN). A revision that breaks its bake rules in
its first ``bake_window_s`` gets a ``rollback`` run: a fresh revision of the version it
replaced is started, takes the traffic (compare-and-set against the bad one), and the bad one
is drained and retired. The registry sensor then leaves that version alone on that endpoint
(``rolled_back`` in its revision details) until its alias names another version. Once an hour
an endpoint's evaluation also carries its last day, replicas against demand, as a plot.
"""


import json
import time
from datetime import datetime, timedelta, timezone

from dagster import (AssetCheckEvaluation, AssetCheckResult, AssetCheckSeverity, AssetKey, Config, DefaultSensorStatus,
                     Failure, MetadataValue, OpExecutionContext, RunRequest, SensorEvaluationContext, SensorResult, SkipReason,
                     asset_check, in_process_executor, job, op, sensor)
from sqlalchemy import Engine

from assets.endpoint_health import HealthInputs, HealthReport, HealthThresholds, assess
from assets.metadata import markdown_table
from assets.serving_state import scaling_plot
from assets.served_endpoint import RolloutDriver, _roll_out, served_endpoint
from assets.source_model import model_versions
from autoscale.controller.loop import EndpointLoad
from autoscale.controller.sources import replica_counts, router_loads
from controlplane.revisions import Revision, RevisionStore
from controlplane.routers import RouterStore
from controlplane.scaling import AUTOSCALER_LEASE, AUTOSCALER_LEASE_TTL_S, Lease
from pipelines.resources import ClusterResource, ControlPlaneResource

HEALTH_INTERVAL_S = 30
PLOT_EVERY_S = 3600  # how often an evaluation carries the endpoint's replicas-against-demand plot
CHECK_NAME = "endpoint_health"
ROLLBACK_TAG = "modelplane/rollback-of"
SERVED_ENDPOINT = AssetKey("served_endpoint")


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def _age_s(moment: datetime | None, now: datetime) -> float | None:
    return None if moment is None else max(0.0, (now - _aware(moment)).total_seconds())


def gather(engine: Engine, cluster, revision: Revision, slo_p99_ms: float, load: EndpointLoad,
           now: datetime) -> HealthInputs:
    counts = replica_counts(cluster, revision.id)
    lease = Lease(engine, AUTOSCALER_LEASE, "health-sensor", ttl_s=AUTOSCALER_LEASE_TTL_S).holder_now()
    # the autoscaler renews its lease every second: its last renewal was the expiry minus the TTL
    autoscaler_age = None if lease is None else _age_s(lease[1] - timedelta(seconds=AUTOSCALER_LEASE_TTL_S), now)
    routed_at = revision.details.get("routed_at")
    serving_for_s = _age_s(datetime.fromisoformat(routed_at), now) if routed_at else _age_s(revision.created_at, now)
    # the serving revision's own answers: a new one is not blamed for the errors of the one it replaced
    p99, answers, errors = load.by_revision.get(revision.id, (None, 0, 0))
    return HealthInputs(endpoint=revision.endpoint, revision_id=revision.id, slo_p99_ms=slo_p99_ms,
                        p99_latency_ms=p99, requests=answers, errors=errors,
                        ready_replicas=counts.ready, desired_replicas=revision.desired_replicas,
                        router_heartbeat_age_s=_age_s(RouterStore(engine).newest_heartbeat(), now),
                        autoscaler_heartbeat_age_s=autoscaler_age, serving_for_s=serving_for_s or 0.0)


def health_metadata(inputs: HealthInputs, report: HealthReport, bounds: HealthThresholds = HealthThresholds()) -> dict:
    """What the check saw, as numbers (-1: not known) and one markdown table against its bounds."""
    def known(value: float | None) -> float:
        return value if value is not None else -1.0

    table = markdown_table(["measure", "seen", "bound"], [
        ["p99 latency ms (30 s)", inputs.p99_latency_ms, inputs.slo_p99_ms],
        ["server errors (30 s)", f"{inputs.errors} of {inputs.requests}", f"{bounds.max_error_rate:.1%}"],
        ["ready replicas", inputs.ready_replicas, f"≥ {inputs.desired_replicas}"],
        ["router heartbeat age s", inputs.router_heartbeat_age_s, bounds.heartbeat_stale_s],
        ["autoscaler heartbeat age s", inputs.autoscaler_heartbeat_age_s, bounds.heartbeat_stale_s],
        ["serving for s", inputs.serving_for_s, f"bake rules until {bounds.bake_window_s:g}"]])
    return {"endpoint": inputs.endpoint, "revision": inputs.revision_id,
            "p99_latency_ms": known(inputs.p99_latency_ms), "slo_p99_ms": inputs.slo_p99_ms,
            "answers_30s": inputs.requests, "server_errors_30s": inputs.errors,
            "ready_replicas": inputs.ready_replicas, "desired_replicas": inputs.desired_replicas,
            "router_heartbeat_age_s": known(inputs.router_heartbeat_age_s),
            "autoscaler_heartbeat_age_s": known(inputs.autoscaler_heartbeat_age_s),
            "problems": "\n".join(report.problems) or "none", "rollback": report.rollback_reason or "no",
            "health": MetadataValue.md(table)}


def evaluation(inputs: HealthInputs, report: HealthReport, partition: str,
               extra: dict | None = None) -> AssetCheckEvaluation:
    return AssetCheckEvaluation(
        asset_key=SERVED_ENDPOINT, check_name=CHECK_NAME, passed=report.passed, partition=partition,
        severity=AssetCheckSeverity.WARN, description=f"{inputs.endpoint}: {report.describe()}",
        metadata={**health_metadata(inputs, report), **(extra or {})})


def plots_due(cursor: str | None, endpoints: list[str], now_s: float, every_s: float = PLOT_EVERY_S) -> tuple[list[str], str]:
    """Which endpoints' evaluations carry the replicas-against-demand plot this tick, and the next cursor.

    A PNG in every 30 s evaluation would fill the event log (~30 kB × 2,880 a day per endpoint);
    once an hour keeps the day's picture current. The cursor is ``{endpoint: when last plotted, s}``.

    >>> plots_due(None, ["gec"], 7200.0)
    (['gec'], '{"gec": 7200.0}')
    >>> plots_due('{"gec": 7200.0}', ["gec", "new"], 9000.0)
    (['new'], '{"gec": 7200.0, "new": 9000.0}')
    """
    plotted = json.loads(cursor) if cursor else {}
    due = [e for e in endpoints if now_s - plotted.get(e, float("-inf")) >= every_s]
    plotted = {e: (now_s if e in due else plotted[e]) for e in endpoints}  # endpoints gone are forgotten
    return due, json.dumps(plotted)


def health_of_serving(control_plane: ControlPlaneResource, cluster: ClusterResource,
                      thresholds: HealthThresholds = HealthThresholds()):
    """``[(inputs, report, revision)]`` for every endpoint with a serving revision."""
    engine = control_plane.engine()
    revisions, now = RevisionStore(engine), datetime.now(timezone.utc)
    specs = {spec.name: spec for spec in control_plane.endpoints().list()}
    traffic = revisions.traffic()
    if not traffic:
        return []
    loads, client, out = router_loads(engine), cluster.client(), []
    for endpoint, revision_id in sorted(traffic.items()):
        revision, spec = revisions.get(revision_id), specs.get(endpoint)
        if revision is None or spec is None:
            continue
        inputs = gather(engine, client, revision, spec.slo.p99_latency_ms, loads.get(endpoint, EndpointLoad()), now)
        out.append((inputs, assess(inputs, thresholds), revision))
    return out


class RollbackConfig(Config):
    endpoint: str
    bad_revision: str
    to_revision: str
    reason: str


@op(description="Serve the endpoint's previous version again: start it, move the traffic, retire the bad revision.")
def rollback_endpoint(context: OpExecutionContext, config: RollbackConfig, control_plane: ControlPlaneResource,
                      cluster: ClusterResource) -> str:
    engine = control_plane.engine()
    revisions = RevisionStore(engine)
    bad, target = revisions.get(config.bad_revision), revisions.get(config.to_revision)
    if bad is None or target is None:
        raise Failure(description=f"cannot roll back {config.bad_revision} to {config.to_revision}: "
                                  "one of them no longer exists", allow_retries=False)
    if revisions.traffic().get(config.endpoint) != bad.id:
        context.log.info(f"{config.endpoint} no longer serves {bad.id}; nothing to roll back")
        return "superseded"
    # marked first: the registry sensor must not deploy this version again while the rollback runs
    revisions.add_details(bad.id, rolled_back=config.reason)
    fresh = revisions.create(config.endpoint, target.partition_key, target.model_dir, target.runtime,
                             target.runtime_config, max(1, bad.desired_replicas),
                             {**target.details, "rollback_of": bad.id, "run_id": context.run_id})
    driver = RolloutDriver(cluster.client(), revisions, context.log.info, routers=RouterStore(engine))
    result = _roll_out(driver, revisions, config.endpoint, fresh.id, max(1, bad.desired_replicas), bad.id)
    if not result.ok:
        raise Failure(description=f"{config.endpoint}: the rollback to {target.partition_key} failed: {result.reason}; "
                                  f"{bad.id} keeps serving", allow_retries=False)
    context.log.info(f"{config.endpoint}: rolled back from {bad.partition_key} to {target.partition_key} "
                     f"({config.reason})")
    return fresh.id


@job(name="rollback", description="Roll an endpoint back to the revision its failed one replaced.",
     executor_def=in_process_executor)  # one op: a process of its own would only add a start-up
def rollback_job():
    rollback_endpoint()


@asset_check(asset=served_endpoint, name=CHECK_NAME, partitions_def=model_versions, blocking=False,
             description="p99 against the SLO, server errors, ready against desired replicas, and the routers' and "
                         "autoscaler's heartbeats; evaluated every 30 s by endpoint_health_sensor, which rolls back "
                         "a revision that breaks its bake rules.",
             metadata={"interval_s": HEALTH_INTERVAL_S, "docs": "docs/reliability.md"})
def endpoint_health(context, control_plane: ControlPlaneResource, cluster: ClusterResource) -> AssetCheckResult:
    partition = context.partition_key
    try:
        checked = health_of_serving(control_plane, cluster)
    except Exception as exc:  # noqa: BLE001 - a check that cannot look fails as a check, never fails the deploy run
        return AssetCheckResult(passed=False, severity=AssetCheckSeverity.WARN,
                                description=f"could not gather the endpoint's health: {type(exc).__name__}: {exc}")
    for inputs, report, revision in checked:
        if revision.partition_key == partition:
            return AssetCheckResult(passed=report.passed, severity=AssetCheckSeverity.WARN,
                                    description=f"{inputs.endpoint}: {report.describe()}",
                                    metadata=health_metadata(inputs, report))
    return AssetCheckResult(passed=True, severity=AssetCheckSeverity.WARN,
                            description=f"no endpoint serves {partition} now", metadata={"revision": "none"})


@sensor(minimum_interval_seconds=HEALTH_INTERVAL_S, default_status=DefaultSensorStatus.RUNNING,
        description="Evaluates endpoint_health on every served endpoint (with its replicas against demand over the "
                    "last day, once an hour); rolls back a revision that fails its bake.",
        job=rollback_job)
def endpoint_health_sensor(context: SensorEvaluationContext, control_plane: ControlPlaneResource,
                           cluster: ClusterResource) -> SensorResult | SkipReason:
    checked = health_of_serving(control_plane, cluster)
    if not checked:
        return SkipReason("no endpoint has a serving revision")
    events, requests = [], []
    due, cursor = plots_due(context.cursor, [inputs.endpoint for inputs, _, _ in checked], time.time())
    for inputs, report, revision in checked:
        extra = ({"replicas_vs_demand": scaling_plot(control_plane.engine(), inputs.endpoint,
                                                     revision.details.get("target_concurrency"))}
                 if inputs.endpoint in due else None)
        events.append(evaluation(inputs, report, revision.partition_key, extra))
        replaced = revision.details.get("replaced")
        # never back and forth: a revision that is itself a rollback is not rolled back (it fails the check)
        if (report.rollback_reason and replaced and not revision.details.get("rolled_back")
                and not revision.details.get("rollback_of")):
            context.log.warning(f"{inputs.endpoint}: rolling {revision.id} back to {replaced}: {report.rollback_reason}")
            requests.append(RunRequest(
                run_key=f"rollback-{revision.id}", tags={ROLLBACK_TAG: revision.id, "modelplane/endpoints": inputs.endpoint},
                run_config={"ops": {"rollback_endpoint": {"config": {
                    "endpoint": inputs.endpoint, "bad_revision": revision.id, "to_revision": replaced,
                    "reason": report.rollback_reason}}}}))
        elif not report.passed:
            context.log.warning(f"{inputs.endpoint}: {report.describe()}")
    return SensorResult(run_requests=requests, asset_events=events, cursor=cursor)
