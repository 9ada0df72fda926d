"""The admin API's read routes need a token with the admin scope; health and the signed webhook do not."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from controlplane.admin_api import WebhookReceiver, create_app
from controlplane.specs import parse_spec
from controlplane.store import EndpointStore, WebhookInbox
from controlplane.tokens import TokenStore
from tests.test_webhooks import NOW_S, SECRET, delivery


@pytest.fixture
def admin(migrated_engine):
    EndpointStore(migrated_engine).put(parse_spec("name: gec\nmodel: models:/gec@champion\n"))
    tokens = TokenStore(migrated_engine)
    _, admin_token = tokens.create([], admin=True)
    _, endpoint_token = tokens.create(["gec"])
    receiver = WebhookReceiver(secret=SECRET, inbox=WebhookInbox(migrated_engine), now_s=lambda: NOW_S)
    return TestClient(create_app(migrated_engine, receiver)), admin_token, endpoint_token


@pytest.mark.parametrize("path", ["/endpoints", "/endpoints/gec", "/endpoints/nope"])
@pytest.mark.parametrize("who, status, words", [
    (None, 401, "send 'Authorization: Bearer <admin token>'"),
    ("mp_x_forged", 401, "unknown or revoked token"),
    ("endpoint", 403, "needs the admin scope"),
])
def test_read_routes_refuse_anyone_without_the_admin_scope(admin, path, who, status, words):
    client, _, endpoint_token = admin
    token = endpoint_token if who == "endpoint" else who
    response = client.get(path, headers={"Authorization": f"Bearer {token}"} if token else {})
    assert response.status_code == status
    assert words in response.json()["error"]


def test_an_admin_token_reads_the_specs(admin):
    client, admin_token, _ = admin
    headers = {"Authorization": f"Bearer {admin_token}"}
    assert [spec["name"] for spec in client.get("/endpoints", headers=headers).json()] == ["gec"]
    assert client.get("/endpoints/gec", headers=headers).json()["model"] == "models:/gec@champion"
    assert client.get("/endpoints/nope", headers=headers).status_code == 404


def test_health_and_the_signed_webhook_need_no_token(admin):
    client, _, _ = admin
    assert client.get("/healthz").status_code == 200
    headers, body = delivery()
    assert client.post("/webhooks/mlflow", content=body, headers=headers).json()["status"] == "accepted"
