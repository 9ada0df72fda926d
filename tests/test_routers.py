"""A drain waits until every live router serves a table read after the traffic switch."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

from starlette.testclient import TestClient

from controlplane.routers import RouterStore
from serving.router.app import create_app
from serving.router.config import RouterConfig
from serving.router.table import RoutingTable

T0 = datetime(2027, 1, 15, 8, 0, tzinfo=timezone.utc)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def test_a_router_lags_until_it_reports_a_table_read_after_the_switch(migrated_engine):
    clock = Clock()
    routers = RouterStore(migrated_engine, now=clock)
    routers.report("a", T0 - timedelta(seconds=1))
    routers.report("b", T0 + timedelta(seconds=1))
    assert routers.lagging(since=T0) == ["a"]
    routers.report("a", T0 + timedelta(seconds=2))
    assert routers.lagging(since=T0) == []


def test_a_router_silent_for_ten_seconds_is_not_waited_for(migrated_engine):
    clock = Clock()
    routers = RouterStore(migrated_engine, now=clock)
    routers.report("gone", T0 - timedelta(seconds=1))
    clock.now = T0 + timedelta(seconds=11)
    assert routers.lagging(since=T0) == []
    routers.report("back", T0 - timedelta(seconds=1))
    routers.forget("back")
    assert routers.lagging(since=T0) == []


def test_the_router_reports_when_the_read_of_the_table_it_serves_began():
    reported: list[datetime] = []
    loads: list[datetime] = []

    def load() -> RoutingTable:
        loads.append(datetime.now(timezone.utc))
        return RoutingTable()

    app = create_app(RouterConfig(refresh_interval_s=0.05), load, report=reported.append)
    with TestClient(app):
        time.sleep(0.3)
    assert len(reported) >= 2
    assert all(r <= loaded for r, loaded in zip(reported, loads))  # the read began before the load finished
    assert reported == sorted(reported)


def test_a_drain_waits_for_the_lagging_router_instead_of_a_fixed_grace(migrated_engine):
    from assets.served_endpoint import RolloutDriver
    from cluster.fake import InMemoryCluster
    from controlplane.revisions import RevisionStore

    routers = RouterStore(migrated_engine)
    switched = datetime.now(timezone.utc)
    routers.report("slow-router", switched - timedelta(seconds=1))  # still on the table from before
    driver = RolloutDriver(InMemoryCluster(), RevisionStore(migrated_engine), log=lambda _m: None, routers=routers,
                           poll_s=0.02)
    driver._routed_at = switched
    events = []

    def catch_up():
        time.sleep(0.5)
        events.append("router caught up")
        routers.report("slow-router", datetime.now(timezone.utc))

    threading.Thread(target=catch_up).start()
    driver._wait_for_routers()
    events.append("drain may start")
    assert events == ["router caught up", "drain may start"]
