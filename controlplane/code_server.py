"""``dagster api grpc`` whose run workers are forked from a process that has the code location imported.

``python -m controlplane.code_server <dagster api grpc arguments>`` is Dagster's own code server
(``dagster._cli``, the same arguments, the same gRPC service), with one difference: Dagster starts
each run worker (``DagsterApiServer.StartRun``: a ``multiprocessing.Process`` running the run)
with the ``spawn`` method, a new interpreter that imports Dagster, its CLI and the code location
again (``pipelines.definitions``: MLflow, the assets, the resources) before the first step runs:
6.5 CPU-seconds on a quiet 2-core AVX2 EPYC, 12-17 s of each deploy on a busy one. Here the
workers come from a ``forkserver``, started with the server, whose one process imported those
modules once, single-threaded, before any gRPC thread existed: each run forks it and starts at
its first step. Everything else is multiprocessing's own: the run's arguments, event queue and
termination event pass as they do to a spawned worker, and Dagster terminates and watches the
worker as it would.

Each run worker writes one line to the code server's log as it starts (``run worker N: the
code location was already imported``, or ``not yet imported`` had it been spawned), which
``tests/test_platform.py`` reads.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
from multiprocessing import forkserver

CODE_LOCATION_MODULE = "pipelines.definitions"  # the module `up` passes as ``-m`` (controlplane.services)
#: What the forkserver imports before it forks the first run worker.
PRELOAD = ("controlplane.code_server", "dagster._grpc.impl", CODE_LOCATION_MODULE)
WORKER_LINE = "the code location was"


def run_worker(*args) -> None:
    """Dagster's ``start_run_in_subprocess``, saying first whether its imports were inherited."""
    from dagster._grpc.impl import start_run_in_subprocess

    inherited = "already" if CODE_LOCATION_MODULE in sys.modules else "not yet"
    print(f"run worker {os.getpid()}: {WORKER_LINE} {inherited} imported", file=sys.stderr, flush=True)
    start_run_in_subprocess(*args)


def main(argv: list[str]) -> int:
    from dagster._cli import main as dagster_main
    from dagster._grpc import server

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    # started now, importing beside this server's own load of the code location, so that the
    # first deploy's run worker does not wait for those imports either
    forkserver.ensure_running()
    dagster_init = server.DagsterApiServer.__init__

    def init(self, *args, **kwargs) -> None:
        dagster_init(self, *args, **kwargs)
        self._mp_ctx = context  # the one place the server picks how run workers start

    server.DagsterApiServer.__init__ = init
    # the target StartRun gives each worker, by its importable name (this file runs as __main__)
    server.start_run_in_subprocess = importlib.import_module("controlplane.code_server").run_worker
    sys.argv = ["dagster", "api", "grpc", *argv]
    return dagster_main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
