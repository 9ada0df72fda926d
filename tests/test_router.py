"""The router: admission errors, proxying, streaming, and retries over real sockets."""

import json
import random
import socket
import threading
import time

import pytest
from starlette.testclient import TestClient

from controlplane.tokens import Grant, token_sha256
from serving.router.app import create_app
from serving.router.balancing import p2c
from serving.router.config import RouterConfig
from serving.router.table import RoutingTable, build_table
from tests.conftest import wait_for
from tests.fake_replicas import FakeReplica

GEC_TOKEN, IRIS_TOKEN, ADMIN_TOKEN = "mp_a_gec", "mp_b_iris", "mp_c_admin"
GRANTS = {token_sha256(GEC_TOKEN): Grant("a", frozenset({"gec"}), False),
          token_sha256(IRIS_TOKEN): Grant("b", frozenset({"iris"}), False),
          token_sha256(ADMIN_TOKEN): Grant("c", frozenset(), True)}
ROWS = [[5.1, 3.5, 1.4, 0.2], [6.2, 2.9, 4.3, 1.3]]
IRIS_BODY = {"dataframe_split": {"columns": ["a", "b", "c", "d"], "data": ROWS}}
CHAT_BODY = {"model": "gec", "messages": [{"role": "user", "content": "she go"}]}


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def replicas():
    started = {name: FakeReplica(name).start() for name in ("gec-0", "gec-1", "iris-0")}
    yield started
    for replica in started.values():
        replica.stop()


def make_router(table: RoutingTable, **config) -> TestClient:
    return TestClient(create_app(RouterConfig(**config), lambda: table))


def table_for(gec: list[str], iris: list[str], starting: bool = False) -> RoutingTable:
    ready = {"gec-r1": gec, "iris-r1": iris}
    return build_table(["gec", "iris", "idle"], {"gec": "gec-r1", "iris": "iris-r1"},
                       {"gec-r1": "vllm", "iris-r1": "pyfunc"}, ready,
                       {"gec-r1", "iris-r1"} if starting else set(), GRANTS)


@pytest.fixture
def router(replicas):
    table = table_for([replicas["gec-0"].url, replicas["gec-1"].url], [replicas["iris-0"].url])
    with make_router(table) as client:
        yield client


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_invocations_reach_the_pyfunc_replica(router, replicas):
    response = router.post("/serving-endpoints/iris/invocations", json=IRIS_BODY, headers=auth(IRIS_TOKEN))
    assert response.status_code == 200
    assert response.json() == {"predictions": ["iris-0", "iris-0"]}
    assert replicas["iris-0"].requests == [("/invocations", IRIS_BODY)]


def test_llm_invocations_become_chat_or_completion_requests_named_after_the_endpoint(router, replicas):
    chat = router.post("/serving-endpoints/gec/invocations", json={"messages": CHAT_BODY["messages"]},
                       headers=auth(GEC_TOKEN))
    completion = router.post("/serving-endpoints/gec/invocations", json={"prompt": "she go"}, headers=auth(GEC_TOKEN))
    assert chat.status_code == completion.status_code == 200
    seen = replicas["gec-0"].requests + replicas["gec-1"].requests
    assert sorted(path for path, _ in seen) == ["/v1/chat/completions", "/v1/completions"]
    assert all(body["model"] == "gec" for _, body in seen)


def test_openai_chat_is_proxied_and_streams_through(router):
    plain = router.post("/v1/chat/completions", json=CHAT_BODY, headers=auth(GEC_TOKEN))
    assert plain.json()["choices"][0]["message"]["content"] == "She goes."
    with router.stream("POST", "/v1/chat/completions", json={**CHAT_BODY, "stream": True},
                       headers=auth(GEC_TOKEN)) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    words = [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events if e != "data: [DONE]"]
    assert "".join(words) == "She goes."
    assert events[-1] == "data: [DONE]"


def test_v1_models_lists_the_llm_endpoints_a_token_may_call(router):
    assert [m["id"] for m in router.get("/v1/models", headers=auth(GEC_TOKEN)).json()["data"]] == ["gec"]
    assert router.get("/v1/models", headers=auth(IRIS_TOKEN)).json()["data"] == []
    assert router.get("/v1/models").status_code == 401


@pytest.mark.parametrize(
    "path, body, headers, status, words",
    [
        ("/serving-endpoints/iris/invocations", IRIS_BODY, {}, 401, "missing Authorization"),
        ("/serving-endpoints/iris/invocations", IRIS_BODY, {"Authorization": "Basic abc"}, 401, "Bearer"),
        ("/serving-endpoints/iris/invocations", IRIS_BODY, auth("mp_x_forged"), 401, "unknown or revoked"),
        ("/serving-endpoints/iris/invocations", IRIS_BODY, auth(GEC_TOKEN), 403, "may not call endpoint 'iris'"),
        ("/serving-endpoints/nope/invocations", IRIS_BODY, auth(ADMIN_TOKEN), 404, "no endpoint named 'nope'"),
        ("/serving-endpoints/iris/invocations", b"{not json", auth(IRIS_TOKEN), 400, "not valid JSON"),
        ("/serving-endpoints/iris/invocations", b"[1, 2]", auth(IRIS_TOKEN), 400, "JSON object"),
        ("/serving-endpoints/gec/invocations", {"inputs": [1]}, auth(GEC_TOKEN), 400, "serves an LLM"),
        ("/v1/chat/completions", {"messages": []}, auth(GEC_TOKEN), 400, "'model' is required"),
        ("/v1/chat/completions", {"model": "iris", "messages": []}, auth(IRIS_TOKEN), 400, "is not an LLM"),
        ("/v1/completions", {"model": "idle", "prompt": "x"}, auth(ADMIN_TOKEN), 503, "no revision is serving"),
    ],
)
def test_bad_requests_get_their_status_and_a_message(router, path, body, headers, status, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = router.post(path, content=content, headers={**headers, "Content-Type": "application/json"})
    assert response.status_code == status
    assert words in response.json()["error"]["message"]


def test_oversized_body_gets_413(replicas):
    table = table_for([replicas["gec-0"].url], [replicas["iris-0"].url])
    with make_router(table, max_body_bytes=1000) as client:
        response = client.post("/serving-endpoints/iris/invocations", content=b"{" + b" " * 2000 + b"}",
                               headers=auth(IRIS_TOKEN))
    assert response.status_code == 413
    assert "1000" in response.json()["error"]["message"]
    assert replicas["iris-0"].requests == []


def test_a_request_held_past_its_deadline_gets_503_with_retry_after():
    with make_router(table_for([], [], starting=True), hold_min_s=0.0, hold_max_s=0.5) as client:
        response = client.post("/serving-endpoints/iris/invocations", json=IRIS_BODY, headers=auth(IRIS_TOKEN))
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert "no ready replica within 0.5 s" in response.json()["error"]["message"]


def test_a_request_held_for_an_endpoint_without_replicas_is_sent_when_one_is_ready(replicas):
    tables = [table_for([], [], starting=True)]
    with TestClient(create_app(RouterConfig(refresh_interval_s=0.1), lambda: tables[0])) as client:
        answers = []
        sender = threading.Thread(target=lambda: answers.append(
            client.post("/serving-endpoints/iris/invocations", json=IRIS_BODY, headers=auth(IRIS_TOKEN))))
        sender.start()
        wait_for(lambda: client.app.state.activator.waiting.get("iris") == 1, 5, "the request to be held")
        waiting = client.get("/internal/in-flight", headers=auth(ADMIN_TOKEN)).json()["endpoints"]["iris"]
        tables[0] = table_for([], [replicas["iris-0"].url])
        sender.join(10)
    assert waiting["waiting_requests"] == 1  # what the autoscaler reads to scale from zero
    assert answers[0].status_code == 200 and len(replicas["iris-0"].requests) == 1
    assert client.app.state.activator.waiting == {}


def test_with_the_hold_queue_full_a_request_gets_503_at_once():
    with make_router(table_for([], [], starting=True), max_waiting_per_endpoint=0) as client:
        response = client.post("/serving-endpoints/iris/invocations", json=IRIS_BODY, headers=auth(IRIS_TOKEN))
    assert response.status_code == 503 and "0 requests already wait" in response.json()["error"]["message"]


def test_a_replica_that_refuses_the_connection_is_retried_on_another(replicas):
    """Only a request that cannot have reached a replica moves on (tests/test_router_safety.py)."""
    table = table_for([closed_port_url(), replicas["gec-0"].url], [replicas["iris-0"].url])
    with make_router(table) as client:
        answers = [client.post("/v1/chat/completions", json=CHAT_BODY, headers=auth(GEC_TOKEN)) for _ in range(20)]
        metrics = client.get("/metrics").text
    assert [a.status_code for a in answers] == [200] * 20
    assert {a.json()["replica"] for a in answers} == {"gec-0"}
    retried = [line for line in metrics.splitlines() if line.startswith('modelplane_router_retries_total{endpoint="gec"}')]
    assert retried and float(retried[0].split()[-1]) >= 1


def test_all_replicas_unreachable_is_a_503_not_a_500():
    with make_router(table_for([closed_port_url(), closed_port_url()], [])) as client:
        response = client.post("/v1/completions", json={"model": "gec", "prompt": "x"}, headers=auth(GEC_TOKEN))
    assert response.status_code == 503
    assert "could be reached" in response.json()["error"]["message"]


def test_p2c_sends_to_the_less_loaded_of_two_draws():
    rng = random.Random(7)
    in_flight = {"a": 5, "b": 0, "c": 5}
    picks = [p2c.pick(["a", "b", "c"], in_flight, rng) for _ in range(300)]
    # b is picked whenever it is drawn (2 of 3 pairs contain it); a and c only against each other.
    assert 0.55 < picks.count("b") / 300 < 0.8
    assert p2c.pick(["only"], {}, rng) == "only"


def test_a_token_created_just_after_a_refresh_is_accepted_at_once(replicas):
    """The table was read a moment before the token was committed: the miss must re-read it."""
    new_token = "mp_d_new"
    base = table_for([replicas["gec-0"].url], [replicas["iris-0"].url])
    with_token = build_table(["gec", "iris"], {"gec": "gec-r1", "iris": "iris-r1"},
                             {"gec-r1": "vllm", "iris-r1": "pyfunc"},
                             {"gec-r1": [replicas["gec-0"].url], "iris-r1": [replicas["iris-0"].url]}, set(),
                             GRANTS | {token_sha256(new_token): Grant("d", frozenset({"iris"}), False)})
    reads = []

    def load_table():
        reads.append(1)
        return base if len(reads) == 1 else with_token  # the token exists from the second read on

    with TestClient(create_app(RouterConfig(refresh_interval_s=3600), load_table)) as client:
        response = client.post("/serving-endpoints/iris/invocations", json=IRIS_BODY, headers=auth(new_token))
        assert response.status_code == 200
        reads_before = len(reads)
        assert client.get("/v1/models", headers=auth("mp_e_never")).status_code == 401
        assert len(reads) == reads_before + 1  # an unknown token costs one read, then a 401


def test_bad_tokens_cost_the_database_no_more_than_the_periodic_refresh(replicas):
    """A token a read did not find is refused without another read; made-up tokens share reads,
    which begin at most once per unknown_token_reread_s; a missing or malformed header reads nothing."""
    import concurrent.futures

    table = table_for([replicas["gec-0"].url], [replicas["iris-0"].url])
    read_at: list[float] = []

    def load_table():
        read_at.append(time.monotonic())
        return table

    config = RouterConfig(refresh_interval_s=3600, unknown_token_reread_s=0.3)
    with TestClient(create_app(config, load_table)) as client:
        def models(token: str | None, authorization: str | None = None) -> int:
            headers = auth(token) if token else {"Authorization": authorization} if authorization else {}
            return client.get("/v1/models", headers=headers).status_code

        assert models("mp_x_made_up") == 401 and len(read_at) == 2  # the start, then one read for the miss
        assert [models("mp_x_made_up") for _ in range(20)] == [401] * 20
        assert models(None) == models(None, "Basic abc") == models(None, "Bearer ") == 401
        assert len(read_at) == 2  # the same token again, and no token at all: no read
        before, burst_started = len(read_at), time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            assert set(pool.map(models, [f"mp_y_{i}" for i in range(48)])) == {401}
        burst_s, burst_reads = time.monotonic() - burst_started, len(read_at) - before
        assert [models(f"mp_z_{i}") for i in range(4)] == [401] * 4
        assert models(GEC_TOKEN) == 200
    gaps = [later - earlier for earlier, later in zip(read_at[1:], read_at[2:])]
    # 48 made-up tokens, 16 at a time, share reads: one per 0.3 s of the burst at most
    assert burst_reads <= 1 + burst_s / 0.3 and burst_reads < 48 / 4, (burst_reads, burst_s)
    assert min(gaps) >= 0.3 - 0.01, gaps  # never closer than unknown_token_reread_s


def test_with_a_cost_model_requests_are_priced_in_model_units_and_answers_checked_against_it(replicas):
    from serving.router.cost import RouteCost

    table = table_for([replicas["gec-0"].url], [replicas["iris-0"].url])
    priced = RouteCost(alpha_ms_per_input_token=0.5, beta_ms_per_output_token=20.0, gamma_ms=30.0, concurrency=4)
    table.endpoints["gec"] = table.endpoints["gec"].__class__(**{**table.endpoints["gec"].__dict__, "cost": priced})
    with make_router(table) as client:
        body = CHAT_BODY | {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 10}
        assert client.post("/v1/chat/completions", json=body, headers=auth(GEC_TOKEN)).status_code == 200
        proxy = client.app.state.proxy
        assert proxy.in_flight == {}  # every unit taken was given back
        assert proxy.mean_output["gec"] == 3  # from the answer's usage.completion_tokens
        metrics = client.get("/metrics").text
    assert 'modelplane_router_cost_checked_requests_total{endpoint="gec"} 1.0' in metrics
    # predicted with the reported output: 0.5 × 100 + 20 × 3 + 30 = 140 ms
    assert 'modelplane_router_cost_predicted_seconds_total{endpoint="gec"} 0.14' in metrics


def test_the_periodic_refresh_and_unknown_tokens_rereads_never_read_the_table_at_once(replicas):
    """Made-up tokens arriving while the periodic refresh runs join the read under way or wait
    for the next: reads never overlap, and there are no more than the two kinds' spacing allows."""
    import concurrent.futures
    import threading

    table = table_for([replicas["gec-0"].url], [replicas["iris-0"].url])
    reads: list[tuple[float, float]] = []
    lock = threading.Lock()

    def load_table():  # a slow read: 0.1 s of the database's time
        started = time.monotonic()
        time.sleep(0.1)
        with lock:
            reads.append((started, time.monotonic()))
        return table

    config = RouterConfig(refresh_interval_s=0.3, unknown_token_reread_s=0.3)
    with TestClient(create_app(config, load_table)) as client:
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            statuses = set(pool.map(lambda i: client.get("/v1/models", headers=auth(f"mp_w_{i}")).status_code,
                                    range(160)))
        took_s = time.monotonic() - started
    assert statuses == {401}
    during = sorted(r for r in reads if r[0] >= started)
    overlaps = [(a, b) for a, b in zip(during, during[1:]) if b[0] < a[1]]
    assert not overlaps, overlaps
    assert len(during) <= 2 + took_s / 0.3, (len(during), took_s)
