"""Canary and shadow traffic in the control plane: the store's rules, the admin API, the CLI,
and what the router's table makes of them."""

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from controlplane import db
from controlplane.admin_api import WebhookReceiver, create_app
from controlplane.revisions import RevisionStore
from controlplane.splits import Share, SplitError, SplitStore
from controlplane.specs import parse_spec
from controlplane.store import EndpointStore, WebhookInbox
from controlplane.tokens import TokenStore
from serving.router.table import load_table


def serving_and_candidate(engine):
    revisions = RevisionStore(engine)
    serving = revisions.create("gec", "gec.v1", "/m/1", "vllm", {}, 1)
    candidate = revisions.create("gec", "gec.v2", "/m/2", "vllm", {}, 1)
    revisions.route("gec", serving.id)
    return revisions, serving.id, candidate.id


def test_a_canary_and_a_shadow_are_set_shown_and_cleared(migrated_engine):
    _, serving, candidate = serving_and_candidate(migrated_engine)
    splits = SplitStore(migrated_engine)
    set_ = splits.set("gec", Share(candidate, 10.0), Share(candidate, 50.0))
    assert set_.to_json() == {"endpoint": "gec", "serving": serving, "canary": {"revision": candidate, "percent": 10.0},
                              "shadow": {"revision": candidate, "percent": 50.0}}
    assert splits.get("gec") == set_
    assert splits.routed() == {serving, candidate}  # the reaper spares the candidate
    splits.set("gec", canary=None)
    assert (splits.get("gec").canary, splits.get("gec").shadow) == (None, Share(candidate, 50.0))
    splits.set("gec", shadow=None)
    assert splits.get("gec").shadow is None


def test_a_revision_that_takes_the_traffic_or_retires_leaves_every_split(migrated_engine):
    revisions, serving, candidate = serving_and_candidate(migrated_engine)
    other = revisions.create("gec", "gec.v3", "/m/3", "vllm", {}, 1)
    splits = SplitStore(migrated_engine)
    splits.set("gec", Share(candidate, 10.0), Share(other.id, 50.0))
    revisions.route("gec", candidate, expected_previous=serving)  # the canary was promoted
    assert splits.get("gec").canary is None and splits.get("gec").shadow == Share(other.id, 50.0)
    revisions.set_state(other.id, "retired")
    assert splits.get("gec").shadow is None


@pytest.mark.parametrize("endpoint, share, status, words", [
    ("iris", "candidate", 404, "no endpoint named 'iris'"),
    ("gec", "nope", 404, "no revision 'nope' of endpoint 'gec'"),
    ("gec", "serving", 400, "already serves"),
    ("gec", "retired", 409, "is retired"),
])
def test_a_split_that_cannot_be_set_is_refused_with_a_reason(migrated_engine, endpoint, share, status, words):
    revisions, serving, candidate = serving_and_candidate(migrated_engine)
    retired = revisions.create("gec", "gec.v0", "/m/0", "vllm", {}, 1)
    revisions.set_state(retired.id, "retired")
    revision = {"candidate": candidate, "serving": serving, "retired": retired.id}.get(share, share)
    with pytest.raises(SplitError) as refused:
        SplitStore(migrated_engine).set(endpoint, Share(revision, 10.0), None)
    assert refused.value.status == status and words in str(refused.value)


@pytest.mark.parametrize("percent", [0.0, 100.0, -5.0, 120.0])
def test_a_canary_percent_must_be_a_share(migrated_engine, percent):
    _, _, candidate = serving_and_candidate(migrated_engine)
    with pytest.raises(SplitError, match="canary percent"):
        SplitStore(migrated_engine).set("gec", Share(candidate, percent), None)


def test_the_routing_table_carries_the_splits_with_their_ready_replicas(migrated_engine):
    from sqlalchemy.orm import Session

    from controlplane.schema import ReplicaRow

    EndpointStore(migrated_engine).put(parse_spec("name: gec\nmodel: models:/gec@champion\n"))
    _, serving, candidate = serving_and_candidate(migrated_engine)
    SplitStore(migrated_engine).set("gec", Share(candidate, 20.0), Share(candidate, 5.0))
    table = load_table(migrated_engine)
    assert table.endpoints["gec"].canary.replicas == ()  # no ready replica yet: it takes nothing
    with Session(migrated_engine) as session, session.begin():
        from datetime import datetime, timezone

        now = datetime.now(timezone.utc)
        session.add(ReplicaRow(id=f"{candidate}-0", revision_id=candidate, host="127.0.0.1", port=9001,
                               state="ready", pid=None, restarts=0, updated_at=now))
    route = load_table(migrated_engine).endpoints["gec"]
    assert (route.canary.revision_id, route.canary.percent, route.canary.replicas) == \
        (candidate, 20.0, ("http://127.0.0.1:9001",))
    assert (route.shadow.revision_id, route.shadow.percent) == (candidate, 5.0)


@pytest.fixture
def admin(migrated_engine):
    _, admin_token = TokenStore(migrated_engine).create([], admin=True)
    client = TestClient(create_app(migrated_engine, WebhookReceiver(secret="s", inbox=WebhookInbox(migrated_engine))))
    return client, {"Authorization": f"Bearer {admin_token}"}


def test_the_admin_api_sets_and_reads_the_splits(admin, migrated_engine):
    client, headers = admin
    _, serving, candidate = serving_and_candidate(migrated_engine)
    answer = client.put("/endpoints/gec/traffic", json={"canary": {"revision": candidate, "percent": 10}},
                        headers=headers)
    assert answer.status_code == 200 and answer.json()["canary"] == {"revision": candidate, "percent": 10.0}
    assert client.get("/endpoints/gec/traffic", headers=headers).json()["serving"] == serving
    shadowed = client.put("/endpoints/gec/traffic", json={"shadow": {"revision": candidate, "percent": 5}},
                          headers=headers).json()
    assert shadowed["canary"]["percent"] == 10.0  # a missing key leaves it
    assert client.put("/endpoints/gec/traffic", json={"canary": None}, headers=headers).json()["canary"] is None


@pytest.mark.parametrize("body, status, words", [
    (b"not json", 400, "Expecting value"),
    (b'{"canary": 10}', 400, "canary must be"),
    (b'{"canary": {"revision": "x", "percent": true}}', 400, "canary must be"),
    (b'{"weights": {}}', 400, "'canary' and/or 'shadow'"),
    (b'{"shadow": {"revision": "nope", "percent": 5}}', 404, "no revision 'nope'"),
    (b'{"canary": {"revision": "x", "percent": 1' + b"0" * 400 + b'}}', 400, "not a number"),
    (b"{}", 400, "'canary' and/or 'shadow'"),
])
def test_the_admin_api_refuses_bad_splits_with_a_4xx(admin, migrated_engine, body, status, words):
    client, headers = admin
    serving_and_candidate(migrated_engine)
    answer = client.put("/endpoints/gec/traffic", content=body, headers=headers)
    assert answer.status_code == status and words in answer.json()["error"]


def test_the_cli_sets_shows_and_clears_a_canary(sqlite_url, monkeypatch):
    from controlplane.cli import app

    monkeypatch.setenv("MODELPLANE_DATABASE_URL", sqlite_url)
    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    _, serving, candidate = serving_and_candidate(engine)
    run = lambda *args: CliRunner().invoke(app, ["endpoints", "traffic", "gec", *args])  # noqa: E731
    assert f"canary: {candidate} at 25%" in run("--canary", f"{candidate}=25").output
    assert f"serving {serving}" in run().output
    assert "canary" not in run("--clear").output
    wrong = run("--canary", "no-percent")
    assert wrong.exit_code == 2 and "REVISION=PERCENT" in wrong.output
    refused = run("--canary", f"{serving}=5")
    assert refused.exit_code == 1 and "already serves" in refused.output
