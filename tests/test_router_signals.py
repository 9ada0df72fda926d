"""The router's in-flight signal: per endpoint and replica, the most requests and model units in
flight in each second of the last minute, and the requests started in it (``serving.router.signals``),
read by the autoscaler at ``GET /internal/in-flight``."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from serving.router.app import create_app
from serving.router.config import RouterConfig
from serving.router.cost import RouteCost
from serving.router.signals import InFlightWindow
from tests.conftest import wait_for
from tests.fake_replicas import FakeReplica
from tests.test_router import ADMIN_TOKEN, CHAT_BODY, GEC_TOKEN, auth, table_for

R0, R1 = "http://r0", "http://r1"


def run(events: list[tuple], window: InFlightWindow | None = None) -> InFlightWindow:
    """Apply ``(at_s, "start" | "retry" | "end", replica, units)`` to gec's window."""
    window = window or InFlightWindow("router-a")
    for at_s, kind, replica, units in events:
        if kind == "end":
            window.ended("gec", replica, units, now_s=at_s)
        else:
            window.started("gec", replica, units, now_s=at_s, retry=kind == "retry")
    return window


def buckets(series: dict) -> list[tuple]:
    """(second, max requests, max units, started) of every bucket."""
    return [(b["at_s"], b["in_flight_requests"], b["in_flight_units"], b["started"]) for b in series["buckets"]]


# ---- the window, with time passed explicitly ---------------------------------------------------------

@pytest.mark.parametrize("events, now_s, expected", [
    pytest.param([(100.1, "start", R0, 1.0), (100.2, "start", R1, 2.0), (100.3, "end", R0, 1.0),
                  (100.4, "end", R1, 2.0)], 100.9, [(100, 2, 3.0, 2)],
                 id="the peak within a second counts, though both requests ended in it"),
    pytest.param([(100.5, "start", R0, 1.5)], 103.2, [(100, 1, 1.5, 1), (101, 1, 1.5, 0), (102, 1, 1.5, 0),
                                                      (103, 1, 1.5, 0)],
                 id="a long request shows in every second it spans, started only in the first"),
    pytest.param([(100.5, "start", R0, 1.0), (102.1, "end", R0, 1.0)], 103.0,
                 [(100, 1, 1.0, 1), (101, 1, 1.0, 0), (102, 1, 1.0, 0), (103, 0, 0.0, 0)],
                 id="the second a request ends in still saw it in flight"),
    pytest.param([(100.1, "start", R0, 1.0), (100.1, "end", R0, 1.0), (100.1, "retry", R1, 1.0)], 100.5,
                 [(100, 1, 1.0, 1)],
                 id="a request refused by one replica and sent to another started once"),
    pytest.param([(100.1, "start", R0, 1.0), (100.6, "start", R0, 1.0), (101.2, "start", R1, 1.0),
                  (101.3, "end", R0, 1.0), (101.4, "end", R0, 1.0), (101.5, "start", R0, 1.0)], 101.9,
                 [(100, 2, 2.0, 2), (101, 3, 3.0, 2)],
                 id="started counts the requests of each second"),
    pytest.param([(100.5, "start", R0, 1.0), (99.7, "end", R0, 1.0)], 100.9, [(100, 1, 1.0, 1)],
                 id="a wall clock stepping back counts in the newest bucket"),
])
def test_each_second_keeps_its_peak_and_its_starts(events, now_s, expected):
    gec = run(events).snapshot(now_s, since_s=expected[0][0])["endpoints"]["gec"]
    assert buckets(gec) == expected


def test_replicas_keep_their_own_levels_and_the_endpoint_their_sum():
    window = run([(100.1, "start", R0, 1.0), (100.2, "start", R1, 2.5), (100.3, "start", R1, 2.5),
                  (100.4, "end", R0, 1.0)])
    gec = window.snapshot(100.9, since_s=100, replica_buckets=True)["endpoints"]["gec"]
    assert (gec["in_flight_requests"], gec["in_flight_units"], gec["waiting_requests"]) == (2, 5.0, 0)
    assert {url: (r["in_flight_requests"], r["in_flight_units"], buckets(r)) for url, r in gec["replicas"].items()} == {
        R0: (0, 0.0, [(100, 1, 1.0, 1)]),
        R1: (2, 5.0, [(100, 2, 5.0, 2)]),
    }


@pytest.mark.parametrize("now_s, seconds", [
    (100.0, list(range(41, 101))),  # exactly the last 60 seconds, the current one last
    (159.9, list(range(100, 160))),  # the request's second is the oldest still kept
    (160.0, list(range(101, 161))),  # and it is gone a minute after it began
])
def test_buckets_cover_the_last_minute_and_roll_off(now_s, seconds):
    gec = run([(100.0, "start", R0, 1.0), (100.5, "end", R0, 1.0)]).snapshot(now_s)["endpoints"]["gec"]
    assert [b["at_s"] for b in gec["buckets"]] == seconds
    assert [b["in_flight_requests"] for b in gec["buckets"]] == [int(s == 100) for s in seconds]


def test_replicas_have_buckets_only_when_asked_for():
    window = run([(100.2, "start", R0, 1.0)])
    assert window.snapshot(100.5)["endpoints"]["gec"]["replicas"] == {R0: {"in_flight_requests": 1,
                                                                          "in_flight_units": 1.0}}
    assert len(window.snapshot(100.5, replica_buckets=True)["endpoints"]["gec"]["replicas"][R0]["buckets"]) == 60


def test_since_s_returns_only_the_seconds_not_yet_read():
    window = run([(100.2, "start", R0, 1.0)])
    assert [b["at_s"] for b in window.snapshot(104.5, since_s=103)["endpoints"]["gec"]["buckets"]] == [103, 104]
    assert window.snapshot(104.5, since_s=105)["endpoints"]["gec"]["buckets"] == []


def test_memory_is_bounded_to_a_minute_of_buckets():
    window = InFlightWindow("router-a")
    for second in range(1000):
        window.started("gec", R0, 1.0, now_s=second + 0.1)
        window.ended("gec", R0, 1.0, now_s=second + 0.2)
    stored = window._endpoints["gec"]  # the private store: what the router holds between reads
    assert len(stored.total.buckets) <= 61 and len(stored.replicas[R0].buckets) <= 61


def test_units_return_to_exactly_zero():
    window = run([(100.0, "start", R0, 0.1), (100.0, "start", R0, 0.2), (100.1, "end", R0, 0.1),
                  (100.2, "end", R0, 0.2)])
    gec = window.snapshot(100.5)["endpoints"]["gec"]
    assert gec["in_flight_units"] == 0.0 and gec["replicas"][R0]["in_flight_units"] == 0.0


def test_an_end_without_a_start_changes_nothing():
    window = run([(100.0, "end", R0, 1.0), (100.1, "start", R1, 1.0), (100.2, "end", R1, 1.0),
                  (100.3, "end", R1, 1.0)])
    gec = window.snapshot(100.5)["endpoints"]["gec"]
    assert gec["in_flight_requests"] == 0 and gec["replicas"][R1]["in_flight_requests"] == 0
    assert R0 not in gec["replicas"]


@pytest.mark.parametrize("table, in_flight_on_r0, expected", [
    pytest.param({"gec": (R0, R1)}, False, {"gec": [R0, R1]}, id="the table's replicas are listed while idle"),
    pytest.param({"gec": (R1,)}, False, {"gec": [R1]}, id="an idle replica that left the table is dropped"),
    pytest.param({"gec": (R1,)}, True, {"gec": [R0, R1]}, id="a replica that left is kept while work is on it"),
    pytest.param({"iris": ()}, False, {"iris": []}, id="an idle endpoint that left the table is dropped"),
    pytest.param({"iris": ()}, True, {"gec": [R0], "iris": []}, id="an endpoint that left is kept while busy"),
])
def test_the_window_follows_the_routing_table(table, in_flight_on_r0, expected):
    window = run([(100.0, "start", R0, 1.0), (100.1, "start", R1, 1.0), (100.2, "end", R1, 1.0)])
    if not in_flight_on_r0:
        window.ended("gec", R0, 1.0, now_s=100.3)
    window.retain(table)
    endpoints = window.snapshot(100.5)["endpoints"]
    assert {name: sorted(e["replicas"]) for name, e in endpoints.items()} == expected


def test_a_replica_kept_for_its_work_is_dropped_at_the_next_refresh_once_it_ends():
    window = run([(100.0, "start", R0, 1.0)])
    window.retain({"gec": (R1,)})
    window.ended("gec", R0, 1.0, now_s=101.0)
    window.retain({"gec": (R1,)})
    assert sorted(window.snapshot(101.5)["endpoints"]["gec"]["replicas"]) == [R1]


# A step: (quarter-seconds since the previous one, start (else end), replica, half-units, which to end).
steps = st.lists(st.tuples(st.integers(0, 12), st.booleans(), st.sampled_from([R0, R1]), st.integers(1, 10),
                           st.integers(0, 100)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(steps=steps, read_after_s=st.integers(0, 70))
def test_every_bucket_is_the_peak_of_its_second(steps, read_after_s):
    """Against a plain replay: a second's peak is the highest level in it, counting the one it began with."""
    at_s, events, open_requests = 100.0, [], []
    for quarters, start, replica, halves, which in steps:
        at_s += quarters / 4
        if start or not open_requests:
            open_requests.append((replica, halves / 2))
            events.append((at_s, "start", replica, halves / 2))
        else:
            replica, units = open_requests.pop(which % len(open_requests))
            events.append((at_s, "end", replica, units))
    now_s = at_s + read_after_s
    gec = run(events).snapshot(now_s)["endpoints"].get("gec")
    last = math.floor(now_s)
    expected = []
    for second in range(last - 59, last + 1):
        before = [e for e in events if e[0] < second]
        within = [e for e in events if second <= e[0] < second + 1]
        level = (sum(1 if e[1] == "start" else -1 for e in before), sum(e[3] if e[1] == "start" else -e[3] for e in before))
        peak, started = level, 0
        for event in within:
            sign = 1 if event[1] == "start" else -1
            level = (level[0] + sign, level[1] + sign * event[3])
            peak = (max(peak[0], level[0]), max(peak[1], level[1]))
            started += event[1] == "start"
        expected.append((second, peak[0], peak[1], started))
    if gec is None:
        assert not events
    else:
        assert buckets(gec) == expected
        assert gec["in_flight_requests"] == len(open_requests)


# ---- GET /internal/in-flight ---------------------------------------------------------------------------

T = 1_800_000_000.25  # wall-clock seconds; the router's buckets are keyed by floor(T)


class Clock:
    def __init__(self) -> None:
        self.now_s = T

    def __call__(self) -> float:
        return self.now_s


class HeldReplica(FakeReplica):
    """A healthy replica that answers only once :meth:`answer` is called, holding requests in flight."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.held = 0
        self._go = asyncio.Event()  # bound to the replica's loop at its first wait

    async def _maybe_close(self, request) -> None:
        self.held += 1
        await self._go.wait()

    def answer(self) -> None:
        self._loop.call_soon_threadsafe(self._go.set)


@pytest.fixture
def held():
    replica = HeldReplica("gec-held").start()
    yield replica
    replica.answer()
    replica.stop()


def priced_table(gec_urls: list[str]):
    """gec with a cost model: a 400-character prompt with max_tokens 10 is (50 + 200 + 30) / 4 = 70 units."""
    table = table_for(gec_urls, [])
    priced = RouteCost(alpha_ms_per_input_token=0.5, beta_ms_per_output_token=20.0, gamma_ms=30.0, concurrency=4)
    table.endpoints["gec"] = dataclasses.replace(table.endpoints["gec"], cost=priced)
    return table


PRICED_BODY = CHAT_BODY | {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 10}


def read_in_flight(client: TestClient, query: str = "") -> dict:
    response = client.get(f"/internal/in-flight{query}", headers=auth(ADMIN_TOKEN))
    assert response.status_code == 200
    return response.json()


def test_requests_held_by_a_replica_are_reported_in_flight_then_gone_with_their_peak_kept(held):
    n = 3
    clock = Clock()
    app = create_app(RouterConfig(), lambda: priced_table([held.url]), router_id="router-a", clock=clock)
    with TestClient(app) as client, ThreadPoolExecutor(n) as pool:
        idle = read_in_flight(client)["endpoints"]["gec"]
        assert idle["replicas"] == {held.url: {"in_flight_requests": 0, "in_flight_units": 0.0}}  # from the table
        answers = [pool.submit(client.post, "/v1/chat/completions", json=PRICED_BODY, headers=auth(GEC_TOKEN))
                   for _ in range(n)]
        wait_for(lambda: held.held == n, 10, f"{n} requests to reach the held replica")

        during = read_in_flight(client)
        gec = during["endpoints"]["gec"]
        assert (during["router_id"], during["now_s"], during["bucket_s"]) == ("router-a", T, 1)
        assert (gec["in_flight_requests"], gec["in_flight_units"], gec["waiting_requests"]) == (n, 70.0 * n, 0)
        assert gec["replicas"][held.url]["in_flight_requests"] == n
        assert gec["replicas"][held.url]["in_flight_units"] == 70.0 * n
        assert gec["buckets"][-1] == {"at_s": math.floor(T), "in_flight_requests": n, "in_flight_units": 70.0 * n,
                                      "started": n}
        assert len(gec["buckets"]) == 60

        clock.now_s = T + 1  # they finish in the next second
        held.answer()
        assert [a.result().status_code for a in answers] == [200] * n
        after = read_in_flight(client, "?replica_buckets=true")["endpoints"]["gec"]
        assert (after["in_flight_requests"], after["in_flight_units"]) == (0, 0.0)
        assert after["replicas"][held.url]["in_flight_requests"] == 0
        assert buckets(after)[-2:] == [(math.floor(T), n, 70.0 * n, n), (math.floor(T) + 1, n, 70.0 * n, 0)]
        assert buckets(after["replicas"][held.url])[-2:] == buckets(after)[-2:]

        clock.now_s = T + 2
        assert buckets(read_in_flight(client)["endpoints"]["gec"])[-1] == (math.floor(T) + 2, 0, 0.0, 0)
        assert client.app.state.proxy.in_flight == {}


@pytest.mark.parametrize("headers, query, status, words", [
    ({}, "", 401, "missing Authorization"),
    (auth("mp_x_forged"), "", 401, "unknown or revoked"),
    (auth(GEC_TOKEN), "", 403, "needs the admin scope for /internal/in-flight"),
    (auth(ADMIN_TOKEN), "?since_s=soon", 400, "since_s must be a whole UNIX second"),
    (auth(ADMIN_TOKEN), "?replica_buckets=yes", 400, "replica_buckets must be true or false"),
])
def test_the_signal_answers_admin_tokens_and_well_formed_queries_only(headers, query, status, words):
    with TestClient(create_app(RouterConfig(), lambda: table_for([], []))) as client:
        response = client.get(f"/internal/in-flight{query}", headers=headers)
    assert response.status_code == status
    assert response.json()["error"]["code"] == status and words in response.json()["error"]["message"]


def test_since_s_trims_the_buckets_over_http():
    clock = Clock()
    with TestClient(create_app(RouterConfig(), lambda: table_for([], []), clock=clock)) as client:
        response = client.get(f"/internal/in-flight?since_s={math.floor(T) - 1}", headers=auth(ADMIN_TOKEN))
    assert [b["at_s"] for b in response.json()["endpoints"]["gec"]["buckets"]] == [math.floor(T) - 1, math.floor(T)]
