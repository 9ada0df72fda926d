"""Keeps each version's ``modelplane.serving.*`` MLflow tags true when traffic moves outside a deploy run.

A deploy run writes the serving tags of the version it routes and of the one it replaces
(:mod:`assets.served_endpoint`). Traffic also moves without one: the health sensor's
``rollback`` job, an endpoint deleted (``modelplane endpoints delete``). Every
``SYNC_INTERVAL_S`` this sensor compares each endpoint's traffic row with what it last wrote
for it (its cursor) and rewrites, from the revision store, the tags of every version that
gained or lost an endpoint. A write that fails (MLflow down) keeps that endpoint's old state
in the cursor, so the next tick sees the move again; a version deleted from the registry is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from dagster import DefaultSensorStatus, SensorEvaluationContext, SkipReason, sensor

from assets.serving_state import record_serving
from controlplane.revisions import RevisionStore
from pipelines.registry import RegistryError
from pipelines.resources import ControlPlaneResource, RegistryResource

SYNC_INTERVAL_S = 30

#: endpoint -> (revision id, partition key) of the revision that holds its traffic
Routed = Mapping[str, tuple[str, str]]


@dataclass(frozen=True)
class Rewrite:
    """A version whose serving tags to rewrite, which endpoint's move caused it, and why, should nothing serve it."""

    partition_key: str
    endpoint: str
    reason_if_none: str


def rewrites(last: Routed, now: Routed, routed_at: Mapping[str, str]) -> list[Rewrite]:
    """The versions whose serving tags changed between ``last`` (empty: never synced) and ``now``.

    >>> [r.partition_key for r in rewrites({"gec": ("gec-v2-a", "gec.v2")}, {"gec": ("gec-v1-b", "gec.v1")}, {})]
    ['gec.v1', 'gec.v2']
    """
    out: dict[str, Rewrite] = {}
    for endpoint in sorted(set(last) | set(now)):
        before, after = last.get(endpoint), now.get(endpoint)
        if before == after:
            continue
        if after is not None:
            out.setdefault(after[1], Rewrite(after[1], endpoint, f"its traffic on {endpoint} moved"))
        if before is not None and (after is None or before[1] != after[1]):
            why = (f"replaced by {after[1]} on {endpoint} at {routed_at.get(endpoint, 'an unknown time')}"
                   if after is not None else f"{endpoint} routes to no revision any more (deleted or drained)")
            out.setdefault(before[1], Rewrite(before[1], endpoint, why))
    return sorted(out.values(), key=lambda r: r.partition_key)


def parse_cursor(cursor: str | None) -> dict[str, tuple[str, str]]:
    """What the last tick wrote; empty (sync everything) when there was none or it is of another format."""
    try:
        return {endpoint: (pair[0], pair[1]) for endpoint, pair in json.loads(cursor or "{}").items()}
    except (ValueError, TypeError, AttributeError, IndexError, KeyError):
        return {}


@sensor(
    minimum_interval_seconds=SYNC_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    description="Rewrites the modelplane.serving.* tags of MLflow versions whose traffic moved outside a deploy run "
                "(a rollback, a deleted endpoint).",
)
def serving_tags_sensor(context: SensorEvaluationContext, control_plane: ControlPlaneResource,
                        registry: RegistryResource) -> SkipReason:
    revisions = RevisionStore(control_plane.engine())
    now: dict[str, tuple[str, str]] = {}
    routed_at: dict[str, str] = {}
    for endpoint, revision_id in revisions.traffic().items():
        revision = revisions.get(revision_id)
        if revision is not None:
            now[endpoint] = (revision.id, revision.partition_key)
            routed_at[endpoint] = revision.details.get("routed_at", "")
    last = parse_cursor(context.cursor)
    client = registry.client()
    synced = dict(now)
    written, failed = [], []
    for rewrite in rewrites(last, now, routed_at):
        try:
            record_serving(client, revisions, control_plane.router_url, rewrite.partition_key, rewrite.reason_if_none)
            written.append(rewrite.partition_key)
        except KeyError:  # deleted from the registry since: nothing to tag
            continue
        except RegistryError as exc:
            failed.append(rewrite.partition_key)
            context.log.warning(f"could not rewrite the serving tags of {rewrite.partition_key}, will retry: {exc}")
            # the cursor keeps what this endpoint had, so the next tick sees the move again
            if rewrite.endpoint in last:
                synced[rewrite.endpoint] = last[rewrite.endpoint]
            else:
                synced.pop(rewrite.endpoint, None)
    context.update_cursor(json.dumps({e: list(pair) for e, pair in sorted(synced.items())}))
    if not written and not failed:
        return SkipReason("every version's serving tags match the traffic")
    return SkipReason(f"rewrote the serving tags of {', '.join(written) or 'none'}"
                      + (f"; will retry {', '.join(failed)}" if failed else ""))
