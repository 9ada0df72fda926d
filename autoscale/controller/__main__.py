"""``python -m autoscale.controller``: the autoscaler process ``modelplane up`` starts.

It holds an admin token of its own (created at start, revoked at exit) to read the routers'
``/internal/in-flight``, takes the ``autoscaler`` lease, and ticks every second until
SIGTERM. Its log line ``autoscaler running`` is what ``modelplane up`` waits for.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

from autoscale.controller.local_cpu import LocalCpu
from autoscale.controller.loop import Controller, ControllerConfig
from autoscale.controller.sources import ReplicaMetrics, RouterLoad, read_plans, replica_counts, with_desired
from cluster.hardware import detect_local
from cluster.factory import from_settings
from controlplane.db import make_engine
from controlplane.routers import RouterStore
from controlplane.scaling import AUTOSCALER_LEASE, AUTOSCALER_LEASE_TTL_S, Lease, ScalingStore
from controlplane.settings import Settings
from controlplane.tokens import TokenStore



class WallClock:
    """UNIX seconds: the demand history is kept per wall-clock minute, so that days line up."""

    def now_s(self) -> float:
        return time.time()


def main() -> None:
    settings = Settings.from_env()
    engine = make_engine(settings.database_url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    hardware = detect_local().key
    cluster = from_settings(settings, engine)
    # Replicas' CPU use (the vertical axis) is read from their processes on this machine; on
    # Kubernetes they are pods elsewhere and it is not read (docs/kubernetes.md).
    cpu = LocalCpu(engine) if settings.cluster == "local" else None
    tokens = TokenStore(engine)
    token_id, token = tokens.create([], admin=True, description=f"autoscaler pid {os.getpid()}")
    lease = Lease(engine, AUTOSCALER_LEASE, f"{socket.gethostname()}:{os.getpid()}", ttl_s=AUTOSCALER_LEASE_TTL_S)
    log = lambda message: print(message, flush=True)  # noqa: E731
    controller = Controller(
        plans=lambda: with_desired(read_plans(engine, hardware), cluster), replicas=lambda rid: replica_counts(cluster, rid),
        load=RouterLoad(RouterStore(engine), token, log=log), stats=ReplicaMetrics(cpu=cpu),
        scale=cluster.scale,
        recorder=ScalingStore(engine), is_leader=lease.acquire, clock=WallClock(),
        config=ControllerConfig(), log=log)
    log(f"autoscaler running (lease holder {lease.holder})")
    heartbeat = os.environ.get("MODELPLANE_HEARTBEAT_FILE")  # a liveness probe's file (Kubernetes: deploy/)
    try:
        while not stop.is_set():
            try:
                controller.tick()
            except Exception as exc:  # noqa: BLE001 - one bad tick (a database hiccup) must not end the loop
                log(f"tick failed: {type(exc).__name__}: {exc}")
            if heartbeat:
                Path(heartbeat).touch()  # the loop is alive, leader or standby
            stop.wait(controller.config.sample_interval_s)
    finally:
        lease.release()
        tokens.revoke(token_id)
        engine.dispose()


if __name__ == "__main__":
    main()
