"""Where a model version serves now, read from the control plane, for MLflow tags and asset metadata.

The serving tags (:mod:`pipelines.version_tags`) are written from what the revision store
says now, not from what a step believes it did: a version serves an endpoint when the
endpoint's traffic goes to one of its revisions. So a step that refuses or replaces a version
writes "not serving" only where nothing serves it any more, and a re-run writes the same tags.
"""

from __future__ import annotations

from datetime import datetime, timezone

from dagster import MetadataValue
from sqlalchemy import Engine

from assets.metadata import png_markdown
from assets.scaling_plot import DAY_S, MINUTE_S, replicas_vs_demand_png
from controlplane.revisions import RevisionStore
from controlplane.scaling import KEEP_PER_ENDPOINT, ScalingStore
from pipelines.registry import ModelRegistry, parse_partition_key
from pipelines.version_tags import Tags, serving_tags


def endpoint_url(router_url: str, endpoint: str) -> str:
    return f"{router_url.rstrip('/')}/serving-endpoints/{endpoint}/invocations"


def serving_now(revisions: RevisionStore, partition_key: str, router_url: str) -> list[dict]:
    """One dict per endpoint whose traffic goes to a revision of ``partition_key`` (``serving_tags``' input)."""
    serving = []
    for endpoint, revision_id in sorted(revisions.traffic().items()):
        revision = revisions.get(revision_id)
        if revision is None or revision.partition_key != partition_key:
            continue
        since = revision.details.get("routed_at") or revision.created_at.replace(
            tzinfo=revision.created_at.tzinfo or timezone.utc).isoformat()
        serving.append({"endpoint": endpoint, "revision": revision.id, "url": endpoint_url(router_url, endpoint),
                        "checkpoint": revision.details.get("checkpoint"), "since": since})
    return serving


def record_serving(registry: ModelRegistry, revisions: RevisionStore, router_url: str, partition_key: str,
                   reason_if_none: str) -> Tags:
    """Write the version's serving tags from the store; ``reason_if_none`` says why when nothing serves it."""
    model, version = parse_partition_key(partition_key)
    tags = serving_tags(serving_now(revisions, partition_key, router_url), reason_if_none)
    registry.set_version_tags(model, version, tags)
    return tags


def scaling_plot(engine: Engine, endpoint: str, target_concurrency: float | None,
                 now: datetime | None = None) -> MetadataValue | str:
    """The endpoint's last day, replicas against demand, once the autoscaler has recorded a decision in it;
    else a sentence saying there is none yet."""
    now_s = (now or datetime.now(timezone.utc)).timestamp()
    store = ScalingStore(engine)
    decisions = [(d.at.timestamp(), d.replicas) for d in store.recent(endpoint, KEEP_PER_ENDPOINT)
                 if d.axis == "horizontal" and d.replicas is not None]
    if not any(t >= now_s - DAY_S for t, _ in decisions):
        return f"no autoscaler decision for {endpoint} in the last day yet"
    demand = store.demand(endpoint, int((now_s - DAY_S) // MINUTE_S))
    png = replicas_vs_demand_png(decisions, demand, now_s, target_concurrency=target_concurrency,
                                 title=f"{endpoint}: replicas against demand, last 24 h")
    return png_markdown(png, f"{endpoint}: replicas against demand over the last day")
