"""schemathesis against the admin API's and the router's OpenAPI documents: whatever a client
sends that the document allows, the answer is never a 5xx, and every 4xx says what was wrong."""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from controlplane.admin_api import WebhookReceiver, create_app
from controlplane import db
from controlplane.specs import parse_spec
from controlplane.store import EndpointStore, WebhookInbox
from controlplane.tokens import TokenStore
from tests.test_webhooks import NOW_S, SECRET

TOKENS: dict[str, str] = {}


@pytest.fixture(scope="module")
def admin_app(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('admin') / 'controlplane.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    EndpointStore(engine).put(parse_spec("name: gec\nmodel: models:/gec@champion\n"))
    TOKENS["admin"] = TokenStore(engine).create([], admin=True)[1]
    receiver = WebhookReceiver(secret=SECRET, inbox=WebhookInbox(engine), now_s=lambda: NOW_S)
    yield create_app(engine, receiver)
    engine.dispose()


def check(case, headers: dict, **call) -> None:
    response = case.call(headers=headers, **call)
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:300])
    if 400 <= response.status_code < 500:
        assert response.content.strip(), f"{case.method} {case.path}: {response.status_code} with an empty body"


def fuzz_every_operation(app, headers: dict, names: tuple[str, ...] = ()) -> list[str]:
    """Each operation of the app's OpenAPI document, with cases hypothesis draws from it; ``names``:
    endpoints that exist, put in place of most drawn endpoint names (else nearly every case is a 404)."""
    if isinstance(app, str):  # a running server's base URL
        schema, call = schemathesis.openapi.from_url(f"{app}/openapi.json"), {"base_url": app}
    else:
        schema, call = schemathesis.openapi.from_asgi("/openapi.json", app), {}
    fuzzed = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            if names:
                aim_at_existing_endpoints(case, names)
            check(case, headers, **call)

        run()
        fuzzed.append(f"{operation.method.upper()} {operation.path}")
    return fuzzed


def aim_at_existing_endpoints(case, names: tuple[str, ...]) -> None:
    """Three drawn names in four become one of ``names`` (chosen by the drawn name, so reproducibly)."""
    def aimed(drawn):
        pick = sum(map(ord, str(drawn))) % (len(names) + 1)
        return names[pick] if pick < len(names) else drawn

    if case.path_parameters and "name" in case.path_parameters:
        case.path_parameters["name"] = aimed(case.path_parameters["name"])
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = aimed(case.body["model"])


def test_an_admin_gets_no_5xx_and_a_reason_for_each_4xx(admin_app):
    fuzzed = fuzz_every_operation(admin_app, {"Authorization": f"Bearer {TOKENS['admin']}"})
    assert {"GET /endpoints", "POST /webhooks/mlflow"} <= set(fuzzed), fuzzed


def test_an_unauthenticated_client_gets_no_5xx_and_a_reason_for_each_4xx(admin_app):
    assert fuzz_every_operation(admin_app, {})


@pytest.fixture(scope="module")
def router_app():
    """The router in front of healthy replicas (an LLM endpoint and a classic one), so that a 5xx
    could only come from the router itself."""
    from controlplane.tokens import Grant, token_sha256
    from serving.router.app import create_app
    from serving.router.config import RouterConfig
    from serving.router.table import build_table
    from tests.fake_replicas import FakeReplica

    replicas = {name: FakeReplica(name).start() for name in ("gec-0", "iris-0")}
    TOKENS["router"] = "mp_fuzz_admin"
    table = build_table(["gec", "iris"], {"gec": "gec-r1", "iris": "iris-r1"}, {"gec-r1": "vllm", "iris-r1": "pyfunc"},
                        {"gec-r1": [replicas["gec-0"].url], "iris-r1": [replicas["iris-0"].url]}, set(),
                        {token_sha256(TOKENS["router"]): Grant("fuzz", frozenset(), True)}, contexts={"gec-r1": 2048})
    import threading

    import uvicorn

    from serving.runtime.process import free_port

    # the fuzzer makes up a token per request, one after another: each would wait up to the
    # default 0.5 s between table reads for its 401 (tests/test_router.py checks that spacing)
    app = create_app(RouterConfig(refresh_interval_s=60, unknown_token_reread_s=0.01), lambda: table)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.config.port}"  # over real sockets, as clients reach it
    server.should_exit = True
    thread.join(30)
    for replica in replicas.values():
        replica.stop()


def test_the_router_gets_no_5xx_and_a_reason_for_each_4xx(router_app):
    fuzzed = fuzz_every_operation(router_app, {"Authorization": f"Bearer {TOKENS['router']}"}, ("gec", "iris"))
    assert {"POST /serving-endpoints/{name}/invocations", "POST /v1/chat/completions"} <= set(fuzzed), fuzzed


def test_the_router_refuses_an_unauthenticated_client_with_no_5xx(router_app):
    assert fuzz_every_operation(router_app, {})
