"""The router at production depth, over real sockets: rate limits, the wait queue, canary and
shadow traffic, outlier ejection, sticky sessions and the inference log."""

import asyncio
import math
import time
from datetime import datetime, timezone
from dataclasses import replace

import pytest
from starlette.testclient import TestClient

from controlplane.tokens import Grant, token_sha256
from serving.router.app import create_app
from serving.router.config import RouterConfig
from serving.router.inference_log import MemorySink
from serving.router.outliers import EjectionConfig
from serving.router.policy import RateLimit, RoutePolicy
from serving.router.table import EndpointRoute, RoutingTable
from serving.router.traffic import Split
from tests.conftest import wait_for
from tests.fake_replicas import FakeReplica

TOKEN, OTHER = "mp_a_gec", "mp_b_gec"
GRANTS = {token_sha256(TOKEN): Grant("a", frozenset({"gec"}), False),
          token_sha256(OTHER): Grant("b", frozenset({"gec"}), False)}
CHAT = {"model": "gec", "messages": [{"role": "user", "content": "she go"}]}


@pytest.fixture
def fleet():
    started = [FakeReplica(f"gec-{i}").start() for i in range(4)]
    yield started
    for replica in started:
        replica.stop()


def router_for(route: EndpointRoute, sink=None, **config) -> TestClient:
    table = RoutingTable({"gec": route}, GRANTS)
    return TestClient(create_app(RouterConfig(**config), lambda: table, log_sink=sink))


def route(replicas, **policy) -> EndpointRoute:
    return EndpointRoute("gec", "vllm", "gec-r1", tuple(r.url for r in replicas), policy=RoutePolicy(**policy))


def chat(client, token=TOKEN, **headers):
    return client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {token}", **headers})


def test_a_rate_limit_answers_429_with_a_retry_after_a_client_can_follow(fleet):
    limited = route(fleet[:1], endpoint_requests=RateLimit(rate_per_s=2.0, burst=2.0))
    with router_for(limited) as client:
        assert [chat(client).status_code for _ in range(2)] == [200, 200]
        refused = chat(client)
        assert refused.status_code == 429
        assert "endpoint gec: 2 requests/s" in refused.json()["error"]["message"]
        wait_s = int(refused.headers["Retry-After"])
        assert wait_s >= 1
        time.sleep(wait_s)
        assert chat(client).status_code == 200  # following Retry-After gets through
        metrics = client.get("/metrics").text
    assert 'modelplane_router_rate_limited_total{endpoint="gec",limit="endpoint gec: 2 requests/s"} 1.0' in metrics


def test_a_per_token_limit_leaves_other_tokens_alone(fleet):
    limited = route(fleet[:1], token_requests=RateLimit(rate_per_s=0.01, burst=1.0))
    with router_for(limited) as client:
        assert chat(client).status_code == 200
        assert chat(client).status_code == 429
        assert chat(client, OTHER).status_code == 200
        limited = client.get("/metrics").text
    assert 'limit="per token: 0.01 requests/s"' in limited


def test_a_request_costing_more_than_the_burst_is_413_not_429(fleet):
    costly = route(fleet[:1], endpoint_units=RateLimit(rate_per_s=0.5, burst=0.5))  # every request costs ≥ 1 unit
    with router_for(costly) as client:
        answer = chat(client)
    assert answer.status_code == 413
    assert "retrying cannot help" in answer.json()["error"]["message"]


def test_the_wait_queue_refuses_beyond_its_length_and_times_out_waiters(fleet):
    fleet[0].behaviour = "stall"
    queued = route(fleet[:1], max_concurrent_requests=1, max_queued_requests=1, max_queue_wait_s=0.3)
    app = create_app(RouterConfig(request_timeout_s=2.0), lambda: RoutingTable({"gec": queued}, GRANTS))

    async def scenario():
        import httpx

        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
                headers = {"Authorization": f"Bearer {TOKEN}"}
                running = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers=headers))
                await asyncio.sleep(0.2)
                waiting = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers=headers))
                await asyncio.sleep(0.05)
                refused = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
                timed_out = await waiting
                running.cancel()
                return refused, timed_out

    refused, timed_out = asyncio.run(scenario())
    assert refused.status_code == 429 and "waiting" in refused.json()["error"]["message"]
    assert timed_out.status_code == 503 and "Retry-After" in timed_out.headers


def test_a_canary_takes_its_percentage_within_5_points_over_2000_requests(fleet):
    split = replace(route(fleet[:2]), canary=Split("gec-r2", tuple(r.url for r in fleet[2:]), 20.0))
    with router_for(split) as client:
        replicas = [chat(client).json()["replica"] for _ in range(2000)]
        counted = client.get("/metrics").text
    canary_share = sum(name in ("gec-2", "gec-3") for name in replicas) / len(replicas)
    assert abs(canary_share - 0.20) <= 0.05
    assert 'role="canary"' in counted


def test_shadow_answers_never_reach_the_client_and_a_failing_shadow_fails_nothing(fleet):
    fleet[1].behaviour = "error"  # the shadow revision answers 500 to everything
    shadowed = replace(route(fleet[:1]), shadow=Split("gec-r2", (fleet[1].url,), 100.0))
    with router_for(shadowed) as client:
        answers = [chat(client) for _ in range(20)]
        wait_for(lambda: len(fleet[1].requests) == 20, 10, "the shadow copies")
        metrics = client.get("/metrics").text
    assert all(a.status_code == 200 and a.json()["replica"] == "gec-0" for a in answers)
    assert len(fleet[0].requests) == 20
    assert 'modelplane_router_revision_requests_total{code="500",endpoint="gec",revision="gec-r2",role="shadow"} 20.0' \
        in metrics


def test_a_failing_replica_is_ejected_and_returns_after_its_ejection_time(fleet):
    fleet[0].behaviour = "error"
    # 3 s of ejection: on 2 busy cores 40 requests once took over a second, the ejection ended
    # among them and the replica was sent 3 more (6, not 3)
    ejecting = route(fleet[:2], ejection=EjectionConfig(consecutive_failures=3, base_ejection_s=3.0,
                                                        max_ejected_percent=50.0))
    with router_for(ejecting) as client:
        for _ in range(20):
            chat(client)
        served_before = len(fleet[0].requests)
        assert served_before == 3  # the third consecutive 500 ejected it
        fleet[0].behaviour = "ok"
        assert {chat(client).json()["replica"] for _ in range(10)} == {"gec-1"}  # still ejected
        assert 'modelplane_router_ejected_replicas{endpoint="gec"} 1.0' in client.get("/metrics").text
        time.sleep(3.1)
        back = {chat(client).json()["replica"] for _ in range(40)}
        metrics = client.get("/metrics").text
    assert back == {"gec-0", "gec-1"}
    assert 'modelplane_router_ejections_total{endpoint="gec"} 1.0' in metrics


def test_the_last_replica_is_never_ejected(fleet):
    fleet[0].behaviour = "error"
    with router_for(route(fleet[:1], ejection=EjectionConfig(consecutive_failures=1))) as client:
        assert [chat(client).status_code for _ in range(5)] == [500] * 5
        assert len(fleet[0].requests) == 5


def test_a_session_sticks_to_one_replica_while_its_load_allows(fleet):
    sticky = route(fleet, sticky="session", session_header="x-session-id")
    with router_for(sticky) as client:
        # 16 sessions: the ring hashes the replicas' URLs, whose ports change every run, and 5
        # sessions all landed on one of 4 replicas once (4 · 4⁻⁵ ≈ 0.4 % of runs); 16: 4 · 4⁻¹⁶
        per_session = {session: {chat(client, **{"X-Session-Id": session}).json()["replica"] for _ in range(5)}
                       for session in (f"user-{n}" for n in range(16))}
        stuck = client.get("/metrics").text
    assert all(len(replicas) == 1 for replicas in per_session.values())
    assert len({next(iter(r)) for r in per_session.values()}) > 1  # sessions spread over replicas
    assert 'modelplane_router_sticky_requests_total{endpoint="gec",home="true"} 80.0' in stuck


def test_the_inference_log_records_sampled_requests_with_capped_payloads(fleet):
    sink = MemorySink()
    logged = route(fleet[:1], log_sample_rate=1.0, log_payloads=True, log_max_payload_bytes=16)
    with router_for(logged, sink) as client:
        for _ in range(3):
            assert chat(client).status_code == 200
    records = sink.records  # the writer flushes on shutdown
    assert len(records) == 3
    record = records[0]
    assert (record.endpoint, record.revision_id, record.kind, record.status, record.token_id) == \
        ("gec", "gec-r1", "serve", 200, "a")
    assert record.request_bytes > 16 and record.request_payload.startswith('{"model"')
    assert "truncated" in record.request_payload and "truncated" in record.response_payload
    assert record.latency_ms > 0 and not math.isnan(record.latency_ms)


def test_an_unsampled_endpoint_writes_nothing(fleet):
    sink = MemorySink()
    with router_for(route(fleet[:1]), sink) as client:
        assert chat(client).status_code == 200
    assert sink.records == []


def test_the_router_prunes_each_endpoint_past_its_retention(fleet):
    class PrunedSink(MemorySink):
        def __init__(self):
            super().__init__()
            self.pruned = []

        def prune(self, older_than, endpoint):
            self.pruned.append((endpoint, older_than))
            return 0

    sink = PrunedSink()
    kept = route(fleet[:1], log_sample_rate=1.0, log_retention_days=2.0)
    with router_for(kept, sink, log_prune_interval_s=0.05):
        wait_for(lambda: sink.pruned, 10, "a prune")
    endpoint, older_than = sink.pruned[0]
    age_days = (datetime.now(timezone.utc) - older_than).total_seconds() / 86400
    assert endpoint == "gec" and 1.99 < age_days < 2.01


def test_the_spec_becomes_the_routers_policy_and_a_broken_one_gets_the_defaults():
    from controlplane.specs import parse_spec
    from serving.router.policy import DEFAULT_POLICY
    from serving.router.table import policy_of

    spec = parse_spec("""
name: gec
model: models:/gec@champion
routing: {balancer: least_loaded, sticky: {key: prefix, prefix_chars: 64, load_factor: 1.5},
          max_concurrent_requests: 8, outlier_ejection: {consecutive_failures: 3}}
rate_limits: {requests_per_s: 10, per_token_model_units_per_s: 500, burst_s: 2}
inference_log: {sample_rate: 0.5, include_payloads: true}
""")
    policy = policy_of("gec", spec.model_dump(mode="json"))
    assert (policy.balancer, policy.sticky, policy.prefix_chars, policy.load_factor) == ("least_loaded", "prefix", 64,
                                                                                          1.5)
    assert policy.endpoint_requests == RateLimit(10.0, 20.0) and policy.token_units == RateLimit(500.0, 1000.0)
    assert policy.endpoint_units is None and policy.token_requests is None
    assert (policy.max_concurrent_requests, policy.ejection.consecutive_failures) == (8, 3)
    assert (policy.log_sample_rate, policy.log_payloads) == (0.5, True)
    assert policy_of("gec", {"name": "gec", "routing": {"balancer": "fastest"}}) == DEFAULT_POLICY


def test_every_balancer_in_the_spec_exists_in_the_router():
    from controlplane.specs import Balancer
    from serving.router.balancing import BALANCERS

    assert {b.value for b in Balancer} == set(BALANCERS)


def test_a_replica_that_times_out_or_drops_connections_is_ejected_too(fleet):
    fleet[0].behaviour, fleet[1].behaviour = "stall", "close"
    ejecting = route(fleet[:3], ejection=EjectionConfig(consecutive_failures=2, max_ejected_percent=100.0))
    with router_for(ejecting, request_timeout_s=0.3, connect_timeout_s=0.3) as client:
        statuses = [chat(client).status_code for _ in range(30)]
        answered = {chat(client).json()["replica"] for _ in range(10)}
    assert statuses.count(504) == 2 and statuses.count(502) == 2  # two each, then ejected
    assert answered == {"gec-2"}


def test_a_client_that_leaves_the_queue_gives_its_place_to_the_next(fleet):
    from serving.router.gatekeeper import acquire_unless_gone
    from serving.router.queueing import ConcurrencyGate

    class Leaving:  # a request whose client disconnects after 0.05 s
        async def receive(self):
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

    class Staying:
        async def receive(self):
            await asyncio.Event().wait()

    async def scenario():
        gate = ConcurrencyGate(1, 4, 5.0)
        await gate.acquire()  # the one slot is taken
        with pytest.raises(Exception) as left:
            await acquire_unless_gone(gate, Leaving())
        waiting_after_leaving = gate.waiting
        staying = asyncio.create_task(acquire_unless_gone(gate, Staying()))
        await asyncio.sleep(0.01)
        gate.release()
        await asyncio.wait_for(staying, 1.0)
        return left.value, waiting_after_leaving, gate.running

    left, waiting_after_leaving, running = asyncio.run(scenario())
    assert getattr(left, "status", None) == 499
    assert waiting_after_leaving == 0 and running == 1  # the next one got the slot
