"""MLflow webhook deliveries: verified, stored once, and anything else refused with nothing written."""

import json

import pytest
from fastapi.testclient import TestClient

from controlplane.admin_api import WebhookReceiver, create_app
from controlplane.store import WebhookInbox
from controlplane.webhooks import WebhookRejected, sign, verify

SECRET = "s3cret"
NOW_S = 1_800_000_000.0


def delivery(event="model_version_alias.created", name="gec", delivery_id="d-1", sent_at_s=NOW_S, secret=SECRET,
             data=None):
    entity, action = event.rsplit(".", 1)
    body = json.dumps({"entity": entity, "action": action, "timestamp": "2027-01-15T08:00:00+00:00",
                       "data": data or {"name": name, "alias": "champion", "version": "3"}}).encode()
    timestamp = str(int(sent_at_s))
    headers = {"X-MLflow-Delivery-Id": delivery_id, "X-MLflow-Timestamp": timestamp,
               "X-MLflow-Signature": sign(secret, delivery_id, timestamp, body), "Content-Type": "application/json"}
    return headers, body


def test_signature_follows_mlflows_scheme_worked_example():
    # base64(HMAC-SHA256("s3cret", "d1.1700000000.{}")), computed independently with openssl
    assert sign("s3cret", "d1", "1700000000", b"{}") == "v1," + __import__("base64").b64encode(
        __import__("hmac").new(b"s3cret", b"d1.1700000000.{}", "sha256").digest()).decode()


def test_valid_delivery_parses_into_a_registry_event():
    headers, body = delivery()
    event = verify(secret=SECRET, delivery_id=headers["X-MLflow-Delivery-Id"], timestamp=headers["X-MLflow-Timestamp"],
                   signature=headers["X-MLflow-Signature"], body=body, now_s=NOW_S)
    assert (event.event, event.registered_model, event.alias, event.version) == (
        "model_version_alias.created", "gec", "champion", "3")


@pytest.fixture
def api(migrated_engine):
    inbox = WebhookInbox(migrated_engine)
    receiver = WebhookReceiver(secret=SECRET, inbox=inbox, now_s=lambda: NOW_S)
    return TestClient(create_app(migrated_engine, receiver, max_body_bytes=4096)), inbox


def test_valid_delivery_is_stored_once(api):
    client, inbox = api
    headers, body = delivery()
    response = client.post("/webhooks/mlflow", content=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "accepted", "event": "model_version_alias.created", "model": "gec"}
    [item] = inbox.pending()
    assert (item.delivery_id, item.registered_model) == ("d-1", "gec")
    assert json.loads(item.payload)["data"]["version"] == "3"


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda h, b: ({**h, "X-MLflow-Signature": sign("wrong", "d-1", h["X-MLflow-Timestamp"], b)}, b), "signature"),
        (lambda h, b: (h, b.replace(b'"gec"', b'"evil"')), "signature"),
        (lambda h, b: ({k: v for k, v in h.items() if k != "X-MLflow-Signature"}, b), "missing"),
        (lambda h, b: ({**h, "X-MLflow-Timestamp": "yesterday"}, b), "integer unix seconds"),
    ],
    ids=["wrong-secret", "altered-body", "unsigned", "bad-timestamp"],
)
def test_forged_delivery_gets_401_and_writes_nothing(api, tamper, message):
    client, inbox = api
    headers, body = tamper(*delivery())
    response = client.post("/webhooks/mlflow", content=body, headers=headers)
    assert response.status_code == 401
    assert message in response.json()["error"]
    assert inbox.pending() == []


@pytest.mark.parametrize("age_s", [301, -301, 86_400])
def test_stale_delivery_gets_401_and_writes_nothing(api, age_s):
    client, inbox = api
    headers, body = delivery(sent_at_s=NOW_S - age_s)
    response = client.post("/webhooks/mlflow", content=body, headers=headers)
    assert response.status_code == 401
    assert "stale" in response.json()["error"]
    assert inbox.pending() == []


def test_replayed_delivery_gets_401_and_is_stored_once(api):
    client, inbox = api
    headers, body = delivery()
    assert client.post("/webhooks/mlflow", content=body, headers=headers).status_code == 200
    replay = client.post("/webhooks/mlflow", content=body, headers=headers)
    assert replay.status_code == 401
    assert "already received" in replay.json()["error"]
    assert len(inbox.pending()) == 1


def test_signed_but_malformed_body_gets_400(api):
    client, inbox = api
    body = b'{"entity": "model_version"}'
    headers = {"X-MLflow-Delivery-Id": "d-2", "X-MLflow-Timestamp": str(int(NOW_S)),
               "X-MLflow-Signature": sign(SECRET, "d-2", str(int(NOW_S)), body)}
    response = client.post("/webhooks/mlflow", content=body, headers=headers)
    assert response.status_code == 400
    assert "data.name" in response.json()["error"]
    assert inbox.pending() == []


def test_oversized_body_gets_413_and_writes_nothing(api):
    client, inbox = api
    headers, _ = delivery()
    response = client.post("/webhooks/mlflow", content=b"x" * 5000, headers=headers)
    assert response.status_code == 413
    assert inbox.pending() == []


def test_events_modelplane_does_not_act_on_are_acknowledged_not_stored(api):
    client, inbox = api
    headers, body = delivery(event="model_version_tag.set", data={"name": "gec", "version": "1", "key": "k", "value": "v"})
    response = client.post("/webhooks/mlflow", content=body, headers=headers)
    assert response.status_code == 200
    assert response.json()["status"] == "ignored"
    assert inbox.pending() == []


def test_unknown_endpoint_is_a_404_with_a_hint(api, migrated_engine):
    from controlplane.tokens import TokenStore

    client, _ = api
    _, token = TokenStore(migrated_engine).create([], admin=True)
    response = client.get("/endpoints/nope", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 404
    assert "modelplane endpoints list" in response.json()["error"]


def test_verify_rejects_an_overlong_delivery_id():
    with pytest.raises(WebhookRejected) as rejected:
        verify(secret=SECRET, delivery_id="x" * 65, timestamp="1", signature="v1,x", body=b"{}", now_s=1.0)
    assert rejected.value.status == 401


def test_a_non_ascii_signature_is_a_401_not_a_crash():
    with pytest.raises(WebhookRejected) as rejected:
        verify(secret=SECRET, delivery_id="d", timestamp=str(int(NOW_S)), signature="v1,ünïcode", body=b"{}",
               now_s=NOW_S)
    assert rejected.value.status == 401
