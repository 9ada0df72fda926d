"""The router's process: ``python -m serving.router.server`` (``modelplane up`` and the Kubernetes
Deployment start it this way). It binds the shared client port and a port of its own
(:func:`listening_sockets`), builds the app of :mod:`serving.router.app` over the control
plane's routing table, reports itself to the control plane, and serves with uvicorn on uvloop
and httptools after :func:`settle_collector`.
"""

from __future__ import annotations

import gc
import socket

from serving.router import tracing
from serving.router.app import create_app
from serving.router.config import RouterConfig


def settle_collector() -> None:
    """Move what start-up made (imported modules, the app, the first table) out of the garbage
    collector's sight (``gc.freeze``), so that a full collection walks only what requests
    create. Without it a full collection walked the whole import graph, about 47 ms with every
    request waiting; with it the router's p99 at 2,000 requests/s fell from 69 ms to 2.6 ms
    (``benchmarks.router_overhead``, docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()


def listening_sockets(host: str, port: int) -> tuple[socket.socket, socket.socket]:
    """(the shared client port, this process's own port).

    The client port is bound with SO_REUSEPORT, so ``modelplane up --routers N`` runs N router
    processes on one port and the kernel spreads connections over them; they share no
    per-request state. Each also listens on a port of its own, which it reports to the control
    plane: the autoscaler must read every router's ``/internal/in-flight``, not whichever the
    kernel hands it.
    """
    shared = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    shared.bind((host, port))
    own = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    own.bind((host, 0))
    return shared, own


def main() -> None:
    import os

    import uvicorn

    from cluster.hardware import detect_local
    from controlplane.db import make_engine
    from controlplane.inference_log import InferenceLogStore
    from controlplane.routers import RouterStore
    from controlplane.settings import Settings
    from serving.router.table import load_table

    settings = Settings.from_env()
    config = RouterConfig(host=settings.host, port=settings.ports.router_port)
    engine = make_engine(settings.database_url)
    hardware = detect_local().key  # the local backend's replicas run on this machine
    feed = None  # local: the supervisor writes replicas into the database, which load_table reads
    if settings.cluster != "local":  # a backend with its own discovery (Kubernetes: EndpointSlices)
        from cluster.factory import ReplicaFeed, from_settings

        feed = ReplicaFeed(from_settings(settings, engine),
                           on_error=lambda exc: print(f"replica discovery: {type(exc).__name__}: {exc}", flush=True))
    shared, own = listening_sockets(config.host, config.port)
    own_url = f"http://{settings.advertise_host or config.host}:{own.getsockname()[1]}"  # where the autoscaler asks
    routers, router_id = RouterStore(engine), f"{socket.gethostname()}:{config.port}:{os.getpid()}"
    app = create_app(config, lambda: load_table(engine, hardware, feed.current if feed else None), router_id=router_id,
                     report=lambda read_at: routers.report(router_id, read_at, own_url),
                     log_sink=InferenceLogStore(engine), tracer=tracing.tracer_from_env(os.environ),
                     on_ready=lambda: print(f"router listening on {config.host}:{config.port} (own port {own_url})",
                                            flush=True))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", loop="uvloop", http="httptools"))
    settle_collector()
    try:
        server.run(sockets=[shared, own])
    finally:
        routers.forget(router_id)


if __name__ == "__main__":
    main()
