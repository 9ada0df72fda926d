"""What the registry sensor should do on one tick (pure logic, no I/O): converge each endpoint.

Desired state is per endpoint: the version its alias names. Actual state is the partition of
the revision its traffic goes to. Every tick, for every endpoint that is not converged, the
sensor asks for a deploy run of the desired version, unless

- a deploy run of the same model is in flight (rollouts of one endpoint never interleave;
  the next tick looks again when it is done);
- the endpoint's last attempt at this version was refused by the eval gate (a decision, not
  a transient failure: retrying would quantize and evaluate the same thing again), or the
  health sensor rolled this version back on this endpoint after it failed its bake, or
  ``max_attempts`` runs for it have failed since the endpoint began wanting it.

Moving an alias back to a version served before is a deploy like any other; when that
version's checkpoint, gate verdict and cost model were built under the spec sections the
endpoint has now (:func:`artifact_sections`), the run only rolls out (``reuse``): no second
quantization. Webhooks give low latency (a delivery for ``gec`` makes this tick look up
every alias watched on ``gec``); polling every ``poll_interval_s`` is the safety net.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pipelines.registry import partition_key

DEFAULT_POLL_INTERVAL_S = 30.0
MAX_ATTEMPTS = 3  # deploy runs of one version for one endpoint, after in-run retries of transient steps
LOST_REQUEST_S = 300.0  # a requested run that never showed up counts as failed after this
RUN_KEY_TAG = "modelplane/run_key"  # on every deploy run the sensor asks for
GATE_TAG = "modelplane/gate"  # "refused" on a run the eval gate stopped (assets/eval_gate.py)


@dataclass(frozen=True)
class Attempt:
    """The version one endpoint is being converged to, since when, and the runs asked for it."""

    partition: str
    since_s: float
    run_keys: tuple[str, ...] = ()
    last_request_s: float | None = None
    sections: str = ""  # artifact_sections of the spec when the attempt began


@dataclass(frozen=True)
class SensorCursor:
    """State carried between ticks in the Dagster sensor cursor (JSON): the last poll, the last
    version seen behind each watched alias, each endpoint's current attempt, a run-key serial."""

    last_poll_s: float | None = None
    resolved: Mapping[str, str | None] = field(default_factory=dict)  # "model@alias" → version
    attempts: Mapping[str, Attempt] = field(default_factory=dict)  # endpoint → attempt
    serial: int = 0

    @classmethod
    def parse(cls, text: str | None) -> SensorCursor:
        if not text:
            return cls()
        data = json.loads(text)
        attempts = {name: Attempt(a["partition"], a["since_s"], tuple(a.get("run_keys", ())), a.get("last_request_s"),
                                  a.get("sections", "")) for name, a in data.get("attempts", {}).items()}
        return cls(data.get("last_poll_s"), dict(data.get("resolved", {})), attempts, int(data.get("serial", 0)))

    def dump(self) -> str:
        return json.dumps({"last_poll_s": self.last_poll_s, "resolved": dict(self.resolved), "serial": self.serial,
                           "attempts": {name: {"partition": a.partition, "since_s": a.since_s,
                                               "run_keys": list(a.run_keys), "last_request_s": a.last_request_s,
                                               "sections": a.sections}
                                        for name, a in self.attempts.items()}})


@dataclass(frozen=True)
class Lookups:
    pairs: tuple[tuple[str, str], ...]  # (registered model, alias) to resolve this tick
    polled: bool  # True when this tick is a full poll


def lookups_for_tick(watched: Iterable[tuple[str, str]], inbox_models: Iterable[str], cursor: SensorCursor,
                     now_s: float, poll_interval_s: float = DEFAULT_POLL_INTERVAL_S) -> Lookups:
    """Which aliases to resolve now: all of them on a poll, else those a webhook touched or never seen.

    >>> cursor = SensorCursor(last_poll_s=100.0, resolved={"gec@champion": "1", "iris@champion": "1"})
    >>> lookups_for_tick([("gec", "champion"), ("iris", "champion")], ["gec"], cursor, now_s=110.0)
    Lookups(pairs=(('gec', 'champion'),), polled=False)
    >>> lookups_for_tick([("gec", "champion"), ("iris", "champion")], [], cursor, now_s=130.0).polled
    True
    """
    watched = sorted(set(watched))
    if cursor.last_poll_s is None or now_s - cursor.last_poll_s >= poll_interval_s:
        return Lookups(pairs=tuple(watched), polled=True)
    touched = set(inbox_models)
    return Lookups(pairs=tuple(p for p in watched if p[0] in touched or f"{p[0]}@{p[1]}" not in cursor.resolved),
                   polled=False)


def _digest(spec, sections: tuple[str, ...]) -> str:
    body = {name: getattr(spec, name).model_dump(mode="json") for name in sections}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


def checkpoint_sections(spec) -> str:
    """A digest of what shapes a version's checkpoint and gate verdict: ``quantization``, ``eval_gate``."""
    return _digest(spec, ("quantization", "eval_gate"))


def cost_sections(spec) -> str:
    """A digest of what shapes a version's cost model: ``cost_model``, ``slo``."""
    return _digest(spec, ("cost_model", "slo"))


def artifact_sections(spec) -> str:
    """Both digests: artifacts built under other sections are not reused for this spec."""
    return f"{checkpoint_sections(spec)}-{cost_sections(spec)}"


@dataclass(frozen=True)
class EndpointView:
    """One endpoint as the tick sees it."""

    name: str
    model: str
    desired_version: str | None  # what its alias names (None: the alias or model does not exist)
    serving_partition: str | None  # what its traffic goes to
    sections: str = ""  # artifact_sections of its spec now
    reusable: bool = False  # the desired version's artifacts were built under today's spec sections
    rolled_back: str | None = None  # why the health sensor rolled the desired version back on this endpoint


@dataclass(frozen=True)
class RunView:
    """A deploy run the sensor asked for, as Dagster knows it (None: not created yet)."""

    status: str | None  # "in_flight" | "success" | "failure" | None
    refused_by_gate: bool = False


@dataclass(frozen=True)
class Deploy:
    partition: str
    endpoints: tuple[str, ...]
    reuse: bool  # roll out only, from the artifacts already built
    run_key: str


@dataclass(frozen=True)
class TickPlan:
    deploys: list[Deploy]
    cursor: SensorCursor
    notes: list[str]  # one line per endpoint that waits or gave up, for the tick's log


def plan_tick(endpoints: list[EndpointView], runs: Mapping[str, RunView], models_in_flight: set[str],
              cursor: SensorCursor, now_s: float, max_attempts: int = MAX_ATTEMPTS) -> TickPlan:
    """Which deploy runs to ask for so that every endpoint serves what its alias names.

    ``runs`` maps the run keys in ``cursor`` to what Dagster says of them.
    """
    attempts: dict[str, Attempt] = {}
    wanted: dict[str, list[EndpointView]] = {}
    notes: list[str] = []
    for view in endpoints:
        if view.desired_version is None:
            continue
        desired = partition_key(view.model, view.desired_version)
        if view.serving_partition == desired:
            continue  # converged: forget the attempt
        attempt = cursor.attempts.get(view.name)
        if attempt is None or attempt.partition != desired or attempt.sections != view.sections:
            attempt = Attempt(desired, now_s, sections=view.sections)
        attempts[view.name] = attempt
        last = runs.get(attempt.run_keys[-1]) if attempt.run_keys else None
        lost = (last is not None and last.status is None and attempt.last_request_s is not None
                and now_s - attempt.last_request_s >= LOST_REQUEST_S)
        if view.rolled_back:
            notes.append(f"{view.name}: {desired} was rolled back ({view.rolled_back}); it keeps its current revision "
                         "until the alias names another version")
            continue
        if view.model in models_in_flight or (last is not None and last.status in (None, "in_flight") and not lost):
            continue  # the run asked for (or another of this model) is queued or running
        if last is not None and last.refused_by_gate:
            notes.append(f"{view.name}: the eval gate refused {desired}; it keeps its current revision until the "
                         "alias moves or the spec changes")
            continue
        failed = sum(1 for key in attempt.run_keys if runs.get(key, RunView(None)).status in ("failure", None))
        if failed >= max_attempts:
            notes.append(f"{view.name}: {failed} deploy runs of {desired} failed; not trying again until the alias "
                         "moves or the spec changes (see the runs in the Dagster UI)")
            continue
        wanted.setdefault(desired, []).append(view)
    deploys, serial = [], cursor.serial
    for partition, views in sorted(wanted.items()):
        serial += 1
        run_key = f"{partition}#{serial}"
        deploys.append(Deploy(partition, tuple(v.name for v in views), all(v.reusable for v in views), run_key))
        for view in views:
            previous = attempts[view.name]
            attempts[view.name] = Attempt(previous.partition, previous.since_s, (*previous.run_keys, run_key), now_s,
                                          previous.sections)
    return TickPlan(deploys, SensorCursor(cursor.last_poll_s, cursor.resolved, attempts, serial), notes)
