"""Endpoint specs and the webhook inbox, stored on SQLite and PostgreSQL."""

from datetime import datetime, timedelta, timezone

from controlplane.specs import parse_spec
from controlplane.store import EndpointStore, WebhookInbox

T0 = datetime(2027, 1, 15, 8, 0, tzinfo=timezone.utc)


class FakeClock:
    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def test_endpoint_specs_round_trip_and_replace(migrated_engine):
    store = EndpointStore(migrated_engine)
    spec = parse_spec("name: gec\nmodel: models:/gec@champion\nscaling: {max_replicas: 8}\n")
    assert store.put(spec) is True
    assert store.get("gec") == spec
    changed = parse_spec("name: gec\nmodel: models:/gec@canary\n")
    assert store.put(changed) is False
    assert store.get("gec").alias == "canary"
    assert [s.name for s in store.list()] == ["gec"]
    assert store.delete("gec") is True
    assert store.delete("gec") is False
    assert store.get("gec") is None


def test_inbox_stores_a_delivery_once_and_drains_in_arrival_order(migrated_engine):
    clock = FakeClock(T0)
    inbox = WebhookInbox(migrated_engine, now=clock)
    assert inbox.add("d-2", "model_version.created", "gec", "{}") is True
    clock.advance(1)
    assert inbox.add("d-1", "model_version_alias.created", "iris", "{}") is True
    assert inbox.add("d-2", "model_version.created", "gec", "{}") is False
    assert [item.delivery_id for item in inbox.pending()] == ["d-2", "d-1"]
    inbox.mark_processed(["d-2"])
    assert [item.delivery_id for item in inbox.pending()] == ["d-1"]
    assert inbox.contains("d-2")
