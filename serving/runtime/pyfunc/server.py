"""Running the scoring server: uvicorn (uvloop + httptools) and, for several workers, a supervisor.

Worker model: ``workers`` separate processes, each with its own listening socket on the same
port (``SO_REUSEPORT``), its own model copy, event loop and predict thread. The kernel spreads
*connections* evenly over the sockets; with uvicorn's own ``--workers`` the processes share
one socket and whichever wakes first accepts, so a router's long-lived keep-alive connections
can pile onto one worker. A worker that dies has its socket closed with it, so the kernel
stops sending it connections while the supervisor restarts it. A worker that dies before its
model ever loaded fails the replica (exit 1) instead: retrying a model that cannot load only
hides the error from the cluster backend, which restarts replicas itself.

With ``workers == 1`` there is no supervisor: the server runs in this process.
"""

from __future__ import annotations

import glob
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

from serving.runtime.pyfunc.config import PyfuncServerConfig

logger = logging.getLogger("serving.runtime.pyfunc")
SHUTDOWN_GRACE_S = 15.0
LISTEN_BACKLOG = 2048


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s")


def serve(config: PyfuncServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    if config.workers == 1:
        return run_worker(config)
    return supervise(config)


def listen_socket(host: str, port: int, *, reuse_port: bool, listen: bool = True) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    if listen:
        sock.listen(LISTEN_BACKLOG)
    return sock


def _load_predictor(model_dir: Path):
    from serving.runtime.pyfunc.predictor import PyfuncPredictor

    return PyfuncPredictor.load(model_dir)


def run_worker(config: PyfuncServerConfig, slot: int = 0, ready_flags=None) -> int:
    """One server process: listen, load the model in the predict thread, serve."""
    import uvicorn

    from serving.runtime.pyfunc.app import PyfuncApp, Readiness
    from serving.runtime.pyfunc.metrics import ServerMetrics

    exit_code = 0

    def on_fatal(exc: BaseException) -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    app = PyfuncApp(config, ServerMetrics.for_this_process(), Readiness(ready_flags, slot), _load_predictor, on_fatal)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, loop="uvloop", http="httptools", lifespan="on",
        access_log=False, log_level="warning", backlog=LISTEN_BACKLOG, timeout_graceful_shutdown=10))
    sock = listen_socket(config.host, config.port, reuse_port=ready_flags is not None)
    logger.info("worker %d serving %s on %s:%d", slot, config.model_dir, config.host, config.port)
    server.run(sockets=[sock])
    return exit_code


def _worker_process(config: PyfuncServerConfig, slot: int, ready_flags) -> None:
    configure_logging()
    raise SystemExit(run_worker(config, slot, ready_flags))


def _metrics_dir() -> tuple[str, bool]:
    """The replica's multiprocess metrics directory, emptied; (path, created here)."""
    existing = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if existing:
        Path(existing).mkdir(parents=True, exist_ok=True)
        for stale in glob.glob(os.path.join(existing, "*.db")):
            os.remove(stale)
        return existing, False
    return tempfile.mkdtemp(prefix="modelplane-pyfunc-metrics-"), True


def supervise(config: PyfuncServerConfig) -> int:
    """Start ``config.workers`` worker processes and keep them running until SIGTERM/SIGINT."""
    metrics_dir, created = _metrics_dir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before any worker imports prometheus_client
    from prometheus_client.multiprocess import mark_process_dead

    # Bound, never listening: holds the port against other programs (fail fast here, not in each
    # worker) and receives no connections itself.
    guard = listen_socket(config.host, config.port, reuse_port=True, listen=False)
    context = multiprocessing.get_context("spawn")  # no fork: model libraries' threads do not survive it
    ready = context.Array("b", config.workers, lock=False)
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}

    def start(slot: int) -> multiprocessing.Process:
        process = context.Process(target=_worker_process, args=(config, slot, ready), name=f"pyfunc-worker-{slot}")
        process.start()
        return process

    workers = [start(slot) for slot in range(config.workers)]
    logger.info("supervising %d workers on %s:%d (metrics in %s)", config.workers, config.host, config.port,
                metrics_dir)
    exit_code = 0
    try:
        while not stopping:
            multiprocessing.connection.wait([p.sentinel for p in workers], timeout=0.5)
            for slot, process in enumerate(workers):
                if stopping or process.is_alive():
                    continue
                mark_process_dead(process.pid, metrics_dir)
                if not ready[slot]:
                    logger.error("worker %d exited (code %s) before its model loaded; stopping the replica", slot,
                                 process.exitcode)
                    exit_code, stopping = 1, True
                    break
                ready[slot] = 0
                logger.warning("worker %d exited (code %s); restarting it", slot, process.exitcode)
                workers[slot] = start(slot)
    finally:
        _stop_workers(workers)
        for process in workers:
            mark_process_dead(process.pid, metrics_dir)
        guard.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if created:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return exit_code


def _stop_workers(workers: list[multiprocessing.Process]) -> None:
    for process in workers:
        if process.is_alive():
            process.terminate()  # SIGTERM: uvicorn finishes in-flight requests
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    for process in workers:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
