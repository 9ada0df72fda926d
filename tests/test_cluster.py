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


# ---- one contract, both backends ------------------------------------------------------------------

@pytest.fixture(params=["in-memory", pytest.param("local", marks=pytest.mark.slow)])
def backend(request, tmp_path):
    """(cluster, model dir, wait): the fake, or the local backend with a real supervisor and pyfunc replicas.

    ``wait(predicate, what)`` returns the predicate's value once it holds: at once for the fake,
    within two minutes for the local backend, whose supervisor converges in the background.
    """
    from tests.conftest import wait_for

    if request.param == "in-memory":
        def immediately(predicate, what):
            value = predicate()
            assert value, what
            return value

        yield InMemoryCluster(), "/models/iris/v1", immediately
        return
    import threading

    from cluster.local.backend import LocalCluster
    from cluster.local.supervisor import Supervisor, SupervisorConfig
    from controlplane import db

    model_dir = request.getfixturevalue("quick_model_dir")
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    supervisor = Supervisor(engine, tmp_path / "logs", SupervisorConfig(restart_backoff_initial_s=0.2))
    stop = threading.Event()
    thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield LocalCluster(engine), str(model_dir), lambda predicate, what: wait_for(predicate, 120, what)
    finally:
        stop.set()
        thread.join(60)
        engine.dispose()


def test_every_backend_keeps_the_cluster_contract(backend):
    cluster, model_dir, wait = backend
    spec = RevisionSpec("iris-r1", "iris", model_dir, "pyfunc", replicas=2)
    cluster.apply(spec)
    cluster.apply(spec)  # idempotent: still two replicas
    ready = wait(lambda: (lambda rs: rs if len(rs) == 2 and all(r.ready for r in rs) else None)(
        cluster.replicas("iris-r1")), "two ready replicas")
    assert [r.replica_id for r in ready] == ["iris-r1-0", "iris-r1-1"]
    assert len({r.url for r in ready}) == 2 and all(r.revision_id == "iris-r1" for r in ready)
    assert {r.replica_id for r in cluster.replicas()} >= {"iris-r1-0", "iris-r1-1"}

    cluster.scale("iris-r1", 1)
    wait(lambda: [r.replica_id for r in cluster.replicas("iris-r1")] == ["iris-r1-0"], "scale down to one")
    with pytest.raises(KeyError):
        cluster.scale("no-such-revision", 1)
    with pytest.raises(ValueError):
        cluster.scale("iris-r1", -1)

    cluster.delete("iris-r1")
    cluster.delete("iris-r1")  # idempotent
    wait(lambda: cluster.replicas("iris-r1") == [], "the revision's replicas to go")


def test_every_backend_stops_the_named_victims_first_and_reuses_their_ids(backend):
    cluster, model_dir, wait = backend
    cluster.apply(RevisionSpec("iris-r2", "iris", model_dir, "pyfunc", replicas=3))

    def running(ids):
        """The revision's replicas, once they are exactly ``ids`` and all ready: the count is exact."""
        return lambda: (lambda rs: {r.replica_id: r.url for r in rs}
                        if [r.replica_id for r in rs] == ids and all(r.ready for r in rs) else None)(
            cluster.replicas("iris-r2"))

    urls = wait(running(["iris-r2-0", "iris-r2-1", "iris-r2-2"]), "three ready replicas")

    cluster.scale("iris-r2", 2, victims=["iris-r2-1", "iris-r2-0"])  # one more victim than the drop
    after = wait(running(["iris-r2-0", "iris-r2-2"]), "the first victim named to go, and only it")
    assert after == {rid: urls[rid] for rid in after}  # the others kept running: same processes

    cluster.scale("iris-r2", 3, victims=["iris-r2-0"])  # a scale-up ignores victims
    after = wait(running(["iris-r2-0", "iris-r2-1", "iris-r2-2"]), "the lowest free index started again")
    assert after["iris-r2-0"] == urls["iris-r2-0"] and after["iris-r2-2"] == urls["iris-r2-2"]
    urls = after

    cluster.scale("iris-r2", 3, victims=["iris-r2-0"])  # so does an unchanged count
    assert running(["iris-r2-0", "iris-r2-1", "iris-r2-2"])() == urls

    cluster.scale("iris-r2", 1, victims=["no-such-replica", "iris-r2-0"])
    after = wait(running(["iris-r2-1"]), "the victim, then the highest index, to go; the unknown id ignored")
    assert after == {"iris-r2-1": urls["iris-r2-1"]}
    cluster.delete("iris-r2")
    wait(lambda: cluster.replicas("iris-r2") == [], "the revision's replicas to go")


def test_ports_picked_together_are_distinct_and_free():
    """A platform's services get ports picked at once: one port given to two services fails
    `up` (a run saw MLflow and Dagster's webserver handed the same one)."""
    import socket

    from cluster.local.replica import free_ports

    for _ in range(5):
        ports = free_ports("127.0.0.1", 200)
        assert len(set(ports)) == 200
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))  # released again once chosen
