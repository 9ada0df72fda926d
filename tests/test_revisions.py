"""Revisions and traffic on SQLite and PostgreSQL: ids that stay unique and fit, a traffic switch
that is a compare-and-set, and an endpoint deletion that leaves nothing behind."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from controlplane.revisions import RevisionStore, TrafficChanged
from controlplane.specs import parse_spec
from controlplane.store import EndpointStore
from controlplane.tokens import TokenStore

LONGEST_NAME = "e" * 63  # an endpoint name is a DNS label: at most 63 characters


def test_revision_ids_stay_unique_under_concurrent_creation_and_fit_the_column(migrated_engine):
    store = RevisionStore(migrated_engine)
    partition = f"{'m' * 200}.v123456789"
    with ThreadPoolExecutor(8) as pool:
        created = list(pool.map(lambda _: store.create(LONGEST_NAME, partition, "/m", "vllm", {}, 1), range(16)))
    ids = [revision.id for revision in created]
    assert len(set(ids)) == 16
    assert all(len(i) <= 96 and i.startswith(LONGEST_NAME) and "v123456789" in i for i in ids)
    assert {r.id for r in store.list(LONGEST_NAME)} == set(ids)  # every one was stored


def test_traffic_moves_only_from_the_revision_the_rollout_saw(migrated_engine):
    store = RevisionStore(migrated_engine)
    first, second, third = (store.create("gec", f"gec.v{n}", "/m", "vllm", {}, 1) for n in (1, 2, 3))
    assert store.route("gec", first.id, expected_previous=None) is None
    with pytest.raises(TrafficChanged) as changed:
        store.route("gec", second.id, expected_previous=None)  # another rollout routed first meanwhile
    assert changed.value.current == first.id
    assert store.route("gec", third.id, expected_previous=first.id) == first.id
    with pytest.raises(TrafficChanged):
        store.route("gec", second.id, expected_previous=first.id)
    assert store.traffic()["gec"] == third.id


def test_two_rollouts_racing_for_one_endpoint_cannot_both_win(migrated_engine):
    store = RevisionStore(migrated_engine)
    base = store.create("gec", "gec.v1", "/m", "vllm", {}, 1)
    store.route("gec", base.id)
    rivals = [store.create("gec", f"gec.v{n}", "/m", "vllm", {}, 1) for n in range(2, 10)]

    def switch(revision):
        try:
            store.route("gec", revision.id, expected_previous=base.id)
            return revision.id
        except TrafficChanged:
            return None

    with ThreadPoolExecutor(8) as pool:
        winners = [w for w in pool.map(switch, rivals) if w]
    assert len(winners) == 1 and store.traffic()["gec"] == winners[0]


def test_deleting_an_endpoint_removes_its_traffic_retires_its_revisions_and_its_tokens(migrated_engine):
    endpoints, revisions, tokens = EndpointStore(migrated_engine), RevisionStore(migrated_engine), \
        TokenStore(migrated_engine)
    endpoints.put(parse_spec("name: gec\nmodel: models:/gec@champion\n"))
    endpoints.put(parse_spec("name: iris\nmodel: models:/iris@champion\n"))
    serving = revisions.create("gec", "gec.v1", "/m", "vllm", {}, 1)
    revisions.route("gec", serving.id)
    revisions.set_state(serving.id, "serving")
    pending = revisions.create("gec", "gec.v2", "/m", "vllm", {}, 1)
    only_gec, _ = tokens.create(["gec"])
    both, _ = tokens.create(["gec", "iris"])

    assert endpoints.delete("gec") is True
    assert "gec" not in revisions.traffic()
    assert {revisions.get(r).state for r in (serving.id, pending.id)} == {"retired"}
    listed = {t["id"]: t for t in tokens.list()}
    assert listed[only_gec]["revoked"] is True
    assert listed[both]["endpoints"] == ["iris"] and listed[both]["revoked"] is False

    endpoints.put(parse_spec("name: gec\nmodel: models:/gec@champion\n"))  # the same name starts clean
    assert "gec" not in revisions.traffic()
    assert not any(g.allows("gec") for g in tokens.grants().values() if not g.admin)
