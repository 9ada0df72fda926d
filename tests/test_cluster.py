"""The Cluster Protocol's shared pieces and its in-memory fake."""

import pytest

from cluster.fake import InMemoryCluster
from cluster.protocol import Replica, RevisionSpec, poll_changes


def replica(name: str, ready: bool = True) -> Replica:
    return Replica(name, "r1", f"http://127.0.0.1:1/{name}", ready, "ready" if ready else "starting")


def test_poll_changes_yields_the_first_list_and_then_only_changes(monkeypatch):
    monkeypatch.setattr("cluster.protocol.time.sleep", lambda _s: None)
    reads = iter([[replica("a")], [replica("a")], [replica("a"), replica("b")], [replica("a"), replica("b")], []])
    seen = poll_changes(lambda: next(reads), interval_s=0.5)
    assert [len(next(seen)) for _ in range(3)] == [1, 2, 0]


def test_fake_cluster_scales_and_deletes_like_the_protocol_says():
    cluster = InMemoryCluster(ready_on_start=False)
    cluster.apply(RevisionSpec("r1", "gec", "/m", "vllm", replicas=3))
    assert [r.replica_id for r in cluster.replicas("r1")] == ["r1-0", "r1-1", "r1-2"]
    assert not any(r.ready for r in cluster.replicas())
    cluster.set_ready("r1-1")
    assert [r.replica_id for r in cluster.replicas() if r.ready] == ["r1-1"]
    cluster.scale("r1", 1)
    assert [r.replica_id for r in cluster.replicas("r1")] == ["r1-0"]
    with pytest.raises(KeyError):
        cluster.scale("nope", 1)
    cluster.delete("r1")
    cluster.delete("r1")  # idempotent
    assert cluster.replicas() == []
