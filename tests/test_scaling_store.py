"""Scaling decisions are a log the CLI and a restarted controller read; one controller holds the lease."""

from __future__ import annotations

from datetime import timedelta

import pytest

from controlplane.routers import RouterStore
from controlplane.scaling import KEEP_PER_ENDPOINT, Lease, ScalingStore

from tests.test_routers import T0
from tests.test_routers import Clock as _Clock


class Clock(_Clock):
    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def test_the_newest_decision_of_each_axis_is_read_back_with_its_reason(migrated_engine):
    clock = Clock()
    store = ScalingStore(migrated_engine, now=clock)
    store.record("gec", "gec-v1-aa", "horizontal", replicas=2, rule="scale-up", reason="7 in flight / 4 = 2",
                 inputs={"in_flight": 7.0})
    clock.advance(5)
    store.record("gec", "gec-v1-aa", "vertical", target=3.5, rule="cut", reason="p99 1400 ms > 1000 ms",
                 inputs={"p99_latency_ms": 1400.0})
    clock.advance(5)
    store.record("gec", "gec-v1-aa", "horizontal", replicas=3, rule="scale-up", reason="11 in flight / 4 = 3",
                 inputs={"in_flight": 11.0})
    horizontal = store.latest("gec", "horizontal")
    assert (horizontal.replicas, horizontal.rule, horizontal.inputs, horizontal.at) == (3, "scale-up", {"in_flight": 11.0},
                                                                                         T0 + timedelta(seconds=10))
    assert store.latest("gec", "vertical").target == 3.5
    assert store.latest("gec", "vertical", revision_id="gec-v2-bb") is None
    assert store.latest("iris", "horizontal") is None
    assert [d.replicas for d in store.recent("gec", limit=2)] == [3, None]


def test_an_unknown_axis_is_refused(migrated_engine):
    with pytest.raises(ValueError, match="axis must be one of"):
        ScalingStore(migrated_engine).record("gec", "r", "diagonal", rule="x", reason="x", inputs={})


def test_the_log_keeps_the_newest_decisions_per_endpoint(sqlite_url):
    from controlplane import db

    db.upgrade(sqlite_url)
    store = ScalingStore(db.make_engine(sqlite_url))
    for n in range(KEEP_PER_ENDPOINT + 5):
        store.record("gec", "r", "horizontal", replicas=n, rule="hold", reason="", inputs={})
    store.record("iris", "r", "horizontal", replicas=1, rule="hold", reason="", inputs={})
    assert len(store.recent("gec", limit=10 * KEEP_PER_ENDPOINT)) == KEEP_PER_ENDPOINT
    assert store.latest("gec", "horizontal").replicas == KEEP_PER_ENDPOINT + 4
    assert store.latest("iris", "horizontal").replicas == 1


def test_one_holder_at_a_time_and_an_expired_lease_is_taken_over(migrated_engine):
    clock = Clock()
    first = Lease(migrated_engine, "autoscaler", "a", ttl_s=10, now=clock)
    second = Lease(migrated_engine, "autoscaler", "b", ttl_s=10, now=clock)
    assert first.acquire() and not second.acquire()
    clock.advance(9)
    assert first.acquire()  # renewed: good for another 10 s
    clock.advance(9)
    assert not second.acquire()
    clock.advance(2)  # 11 s since the last renewal
    assert second.acquire() and not first.acquire()
    assert second.holder_now() == ("b", T0 + timedelta(seconds=30))
    second.release()
    assert first.acquire()


def test_routers_say_where_they_answer_and_silent_ones_drop_out(migrated_engine):
    clock = Clock()
    routers = RouterStore(migrated_engine, now=clock)
    routers.report("r1", T0, "http://127.0.0.1:8100")
    routers.report("r2", T0)  # an older router that does not say where it answers
    clock.advance(5)
    routers.report("r3", T0, "http://127.0.0.1:8101")
    assert routers.live_urls() == {"r1": "http://127.0.0.1:8100", "r3": "http://127.0.0.1:8101"}
    clock.advance(6)
    assert routers.live_urls() == {"r3": "http://127.0.0.1:8101"}
    assert routers.newest_heartbeat() == T0 + timedelta(seconds=5)


def test_demand_per_minute_keeps_the_peak_and_eight_days(migrated_engine):
    store = ScalingStore(migrated_engine)
    store.save_demand("gec", 100, 3.0)
    store.save_demand("gec", 100, 7.0)
    store.save_demand("gec", 100, 5.0)  # a lower sample does not lower the minute's peak
    store.save_demand("gec", 101, 2.0)
    store.save_demand("iris", 101, 9.0)
    assert store.demand("gec", since_minute=0) == {100: 7.0, 101: 2.0}
    assert store.demand("gec", since_minute=101) == {101: 2.0}
    store.save_demand("gec", 100 + 8 * 24 * 60 + 1, 1.0)  # eight days and a minute later
    assert list(store.demand("gec", since_minute=0)) == [101, 100 + 8 * 24 * 60 + 1]
