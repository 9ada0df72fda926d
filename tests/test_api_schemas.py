"""schemathesis against the admin API's OpenAPI document: whatever a client sends that the
document allows (and much that it does not), the answer is never a 5xx, and every 4xx says
what was wrong."""

from __future__ import annotations

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


def check(case, headers: dict) -> None:
    response = case.call(headers=headers)
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:300])
    if 400 <= response.status_code < 500:
        assert response.content.strip(), f"{case.method} {case.path}: {response.status_code} with an empty body"


def fuzz_every_operation(app, headers: dict) -> list[str]:
    """Each operation of the app's OpenAPI document, with cases hypothesis draws from it."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    fuzzed = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            check(case, headers)

        run()
        fuzzed.append(f"{operation.method.upper()} {operation.path}")
    return fuzzed


def test_an_admin_gets_no_5xx_and_a_reason_for_each_4xx(admin_app):
    fuzzed = fuzz_every_operation(admin_app, {"Authorization": f"Bearer {TOKENS['admin']}"})
    assert {"GET /endpoints", "POST /webhooks/mlflow"} <= set(fuzzed), fuzzed


def test_an_unauthenticated_client_gets_no_5xx_and_a_reason_for_each_4xx(admin_app):
    assert fuzz_every_operation(admin_app, {})
