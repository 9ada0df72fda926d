"""``cost_model_sensor``: re-measure a serving version's cost model when it is missing or has drifted.

Every minute it reads which version each endpoint serves, which of those have a profile for
the hardware the replicas run on, and the router's observed-vs-predicted latency counters
(its ``/metrics``); :mod:`pipelines.cost_plan` decides, and each decision becomes a run of
the ``cost_model`` job for that version, with the reason in the run's tags (the asset
stores it with the profile).
"""

import json
import time

import httpx
from dagster import DefaultSensorStatus, RunRequest, SensorEvaluationContext, SensorResult, sensor

from assets.cost_model import REASON_TAG
from cluster.hardware import detect_local
from controlplane.cost_profiles import CostProfileStore
from controlplane.revisions import RevisionStore
from pipelines.cost_plan import CostCounters, decide, parse_router_counters
from pipelines.jobs import cost_model_job
from pipelines.resources import ControlPlaneResource

SENSOR_INTERVAL_S = 60


def _load_cursor(text: str | None) -> tuple[dict[str, CostCounters], dict[str, float]]:
    data = json.loads(text) if text else {}
    return ({k: CostCounters(*v) for k, v in data.get("window_start", {}).items()},
            {k: float(v) for k, v in data.get("requested_missing", {}).items()})


def _dump_cursor(starts: dict[str, CostCounters], asked: dict[str, float]) -> str:
    return json.dumps({"window_start": {k: [c.requests, c.observed_s, c.predicted_s] for k, c in starts.items()},
                       "requested_missing": asked})


@sensor(
    job=cost_model_job,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    description="Re-measures a serving version's cost model when its hardware profile is missing or the "
                "router sees latencies drift from the model's predictions.",
)
def cost_model_sensor(context: SensorEvaluationContext, control_plane: ControlPlaneResource) -> SensorResult:
    engine = control_plane.engine()
    revisions = RevisionStore(engine)
    serving = {}
    for endpoint, revision_id in revisions.traffic().items():
        revision = revisions.get(revision_id)
        if revision is not None and revision.partition_key:
            serving[endpoint] = revision.partition_key
    hardware = detect_local().key
    profiled = set(CostProfileStore(engine).for_hardware(hardware))
    try:
        counters = parse_router_counters(httpx.get(f"{control_plane.router_url}/metrics", timeout=5,
                                                   trust_env=False).text)
    except httpx.HTTPError as exc:
        context.log.warning(f"router metrics unavailable ({exc}); checking for missing profiles only")
        counters = {}
    starts, asked = _load_cursor(context.cursor)
    decisions, starts, asked = decide(serving, profiled, hardware, counters, starts, asked, time.time())
    for decision in decisions:
        context.log.info(f"{decision.partition_key}: {decision.reason}")
    return SensorResult(
        run_requests=[RunRequest(partition_key=d.partition_key, run_key=f"{d.partition_key}:{d.reason}:{time.time():.0f}",
                                 tags={REASON_TAG: d.reason}) for d in decisions],
        cursor=_dump_cursor(starts, asked),
    )
