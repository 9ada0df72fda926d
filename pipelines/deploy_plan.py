"""What the registry sensor should do on one tick (pure logic, no I/O).

Inputs: the endpoint specs, the webhook deliveries waiting in the inbox, the sensor's
cursor and ``now``. Outputs: which (model, alias) pairs to look up in the registry, and,
once looked up, which model versions are new deploys.

Webhooks give low latency: a delivery for model ``gec`` makes this tick look up every
alias that an endpoint spec watches on ``gec``. Polling is the safety net, because MLflow
delivers webhooks fire-and-forget: every ``poll_interval_s`` all watched aliases are
looked up whether or not a delivery arrived.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pipelines.registry import partition_key

DEFAULT_POLL_INTERVAL_S = 30.0


@dataclass(frozen=True)
class SensorCursor:
    """State carried between ticks in the Dagster sensor cursor (JSON).

    ``requested`` holds every partition key a run was requested for, so an alias moved
    back to an old version never deploys that version a second time.
    """

    last_poll_s: float | None = None
    requested: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def parse(cls, text: str | None) -> "SensorCursor":
        if not text:
            return cls()
        data = json.loads(text)
        return cls(last_poll_s=data.get("last_poll_s"), requested=frozenset(data.get("requested", [])))

    def dump(self) -> str:
        return json.dumps({"last_poll_s": self.last_poll_s, "requested": sorted(self.requested)})


@dataclass(frozen=True)
class Lookups:
    pairs: tuple[tuple[str, str], ...]  # (registered model, alias) to resolve this tick
    polled: bool  # True when this tick is a full poll


def lookups_for_tick(
    watched: Iterable[tuple[str, str]],
    inbox_models: Iterable[str],
    cursor: SensorCursor,
    now_s: float,
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
) -> Lookups:
    """Which aliases to resolve now.

    >>> cursor = SensorCursor(last_poll_s=100.0)
    >>> lookups_for_tick([("gec", "champion"), ("iris", "champion")], ["gec"], cursor, now_s=110.0)
    Lookups(pairs=(('gec', 'champion'),), polled=False)
    >>> lookups_for_tick([("gec", "champion"), ("iris", "champion")], [], cursor, now_s=130.0).polled
    True
    """
    watched = sorted(set(watched))
    poll_due = cursor.last_poll_s is None or now_s - cursor.last_poll_s >= poll_interval_s
    if poll_due:
        return Lookups(pairs=tuple(watched), polled=True)
    touched = set(inbox_models)
    return Lookups(pairs=tuple(pair for pair in watched if pair[0] in touched), polled=False)


def new_deploys(resolved: Mapping[tuple[str, str], str | None], already: Iterable[str]) -> list[str]:
    """Partition keys of versions now behind a watched alias that were never requested.

    Two aliases (or two endpoints) pointing at one version give one deploy.

    >>> new_deploys({("gec", "champion"): "3", ("gec", "canary"): "3", ("iris", "champion"): None}, ["gec.v2"])
    ['gec.v3']
    """
    seen = set(already)
    keys = []
    for (model, _alias), version in sorted(resolved.items()):
        if version is None:
            continue
        key = partition_key(model, version)
        if key not in seen:
            seen.add(key)
            keys.append(key)
    return keys


def advance(cursor: SensorCursor, lookups: Lookups, deployed: Iterable[str], now_s: float) -> SensorCursor:
    return SensorCursor(
        last_poll_s=now_s if lookups.polled else cursor.last_poll_s,
        requested=cursor.requested | frozenset(deployed),
    )
