"""``python -m controlplane.prometheus_targets``: what Prometheus scrapes, kept current, and the control plane's
metrics.

``modelplane up --prometheus`` starts it next to Prometheus. Every ``INTERVAL_S`` it reads
the live routers (the ``routers`` table: each router process's own port, where its
``/metrics`` is that process's alone) and the replicas (from the cluster backend, as the
routers' discovery does) and rewrites the targets files under
``$MODELPLANE_HOME/prometheus/targets/`` that changed, through a temporary file and a rename,
so Prometheus (``file_sd_configs``) never reads half a file. A replica's target carries the
labels ``endpoint``, ``revision``, ``replica`` and ``runtime``: the runtimes' own metrics do
not know which endpoint they serve.

It also serves ``/metrics`` for the control plane's state (:mod:`controlplane.state_metrics`:
the supervisor's replica states and restarts, desired counts, the autoscaler's targets and
decisions) on 127.0.0.1, on a port the kernel picks, and lists itself in
``control-plane.json``.

A process of its own rather than a loop in the router, the supervisor or the autoscaler: it
exists only with ``--prometheus``, there is one of it however many routers run, it works the
same whichever backend runs the replicas, and ``up`` restarts it alone if it dies. A read that
fails keeps the previous files: Prometheus goes on scraping what was there.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from cluster.protocol import Replica
from controlplane.prometheus import CONTROL_PLANE_FILE, REPLICAS_FILE, ROUTERS_FILE

INTERVAL_S = 2.0
#: Replicas whose server may not answer yet, or no longer: not scraped (``up`` would read 0 for nothing).
UNSCRAPED_STATES = frozenset({"pending", "starting", "stopped"})

log = logging.getLogger("modelplane.prometheus_targets")


def target_groups(routers: Mapping[str, str], replicas: Iterable[Replica], revisions: Mapping[str, tuple[str, str]],
                  exporter: str) -> dict[str, list[dict]]:
    """Each targets file's content (file_sd groups), sorted so that the same state gives the same bytes.

    ``routers``: router id → its own URL; ``revisions``: revision id → (endpoint, runtime);
    ``exporter``: this process's ``host:port``.

    >>> groups = target_groups({"h:8080:7": "http://127.0.0.1:41000"},
    ...                        [Replica("gec-r1-0", "gec-r1", "http://127.0.0.1:42000", True, "ready"),
    ...                         Replica("gec-r1-1", "gec-r1", "http://127.0.0.1:42001", False, "starting")],
    ...                        {"gec-r1": ("gec", "pyfunc")}, "127.0.0.1:43000")
    >>> groups["routers.json"], groups["control-plane.json"]
    ([{'targets': ['127.0.0.1:41000'], 'labels': {}}], [{'targets': ['127.0.0.1:43000'], 'labels': {}}])
    >>> groups["replicas.json"]
    [{'targets': ['127.0.0.1:42000'], 'labels': {'endpoint': 'gec', 'revision': 'gec-r1', 'replica': 'gec-r1-0', \
'runtime': 'pyfunc'}}]
    """
    router_targets = sorted({urlsplit(url).netloc for url in routers.values() if url})
    replica_groups = []
    for replica in sorted(replicas, key=lambda r: r.replica_id):
        if replica.state in UNSCRAPED_STATES:
            continue
        endpoint, runtime = revisions.get(replica.revision_id, ("", ""))
        replica_groups.append({"targets": [urlsplit(replica.url).netloc],
                               "labels": {"endpoint": endpoint, "revision": replica.revision_id,
                                          "replica": replica.replica_id, "runtime": runtime}})
    return {
        ROUTERS_FILE: [{"targets": router_targets, "labels": {}}] if router_targets else [],
        REPLICAS_FILE: replica_groups,
        CONTROL_PLANE_FILE: [{"targets": [exporter], "labels": {}}],
    }


def write_if_changed(path: Path, groups: list[dict]) -> bool:
    """Replace ``path`` with ``groups`` as JSON unless it holds exactly that already; True when written."""
    text = json.dumps(groups, indent=1) + "\n"
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    temporary = path.with_name(f".{path.name}.tmp")  # not a name Prometheus reads
    temporary.write_text(text)
    os.replace(temporary, path)
    return True


def revisions_by_id(engine) -> dict[str, tuple[str, str]]:
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from controlplane.schema import RevisionRow

    with Session(engine) as session:
        rows = session.execute(select(RevisionRow.id, RevisionRow.endpoint, RevisionRow.runtime)).all()
    return {revision_id: (endpoint, runtime) for revision_id, endpoint, runtime in rows}


def main() -> None:
    from prometheus_client import CollectorRegistry, start_wsgi_server

    from cluster.factory import from_settings
    from cluster.hardware import detect_local
    from controlplane.db import make_engine
    from controlplane.routers import RouterStore
    from controlplane.settings import Settings
    from controlplane.state_metrics import StateCollector, read_snapshot

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env()
    engine = make_engine(settings.database_url)
    cluster, routers, hardware = from_settings(settings, engine), RouterStore(engine), detect_local().key
    registry = CollectorRegistry()
    registry.register(StateCollector(lambda: read_snapshot(engine, cluster.replicas(), hardware)))
    server, _ = start_wsgi_server(0, addr="127.0.0.1", registry=registry)
    exporter = f"127.0.0.1:{server.server_port}"
    directory = settings.prometheus_dir / "targets"
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    announced = False
    while not stop.is_set():
        try:
            groups = target_groups(routers.live_urls(), cluster.replicas(), revisions_by_id(engine), exporter)
        except Exception:  # noqa: BLE001 - a database hiccup: keep the files as they are, try again
            log.exception("reading the routers and replicas failed; targets left as they were")
        else:
            for name, content in groups.items():
                if write_if_changed(directory / name, content):
                    log.info("%s: %d target(s)", name, sum(len(g["targets"]) for g in content))
            if not announced:
                log.info("prometheus targets running (control-plane metrics on %s)", exporter)
                announced = True
        stop.wait(INTERVAL_S)
    server.shutdown()
    engine.dispose()


if __name__ == "__main__":
    main()
