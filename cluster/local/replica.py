"""One replica's life under the local supervisor: start, get ready, stay alive, restart.

:class:`ManagedReplica` runs on a thread of its own: it starts the runtime's process on a
free port (from the revision's mounted serving image where it has one, :mod:`images.mounts`;
handed to a warm pre-started process where one fits, :mod:`cluster.local.warm_pool`), waits
for ``GET /health`` and the runtime's probe request, records the cold start, then watches
forward progress through ``/metrics`` and restarts the process, with exponential backoff,
when it exits or is found hung. What it sees goes into the ``replicas`` table.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import psutil
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from cluster.local.adoption import AdoptedProcess
from cluster.local.cold_start import cold_start_split, launch_from_image
from cluster.local.log_tail import log_size, log_tail
from cluster.local.warm_pool import PoolKey, WarmPool
from controlplane.backoff import restart_delay_s
from controlplane.revisions import ONE_OFF, RevisionStore
from controlplane.routers import RouterStore
from controlplane.schema import ReplicaRow, RevisionRow
from controlplane.settings import REPO_ROOT
from controlplane.store import utc_now
from images.mounts import ImageMounts, MountedImage
from images.ref import ImageRef
from serving.runtime.base import ReplicaLaunch, ReplicaRuntime, RuntimeConfig
from serving.runtime.liveness import LivenessConfig, LivenessState, Verdict, decide
from serving.runtime.process import replica_environment
from serving.tls import tls_context

log = logging.getLogger("modelplane.supervisor")


@dataclass(frozen=True)
class SupervisorConfig:
    host: str = "127.0.0.1"
    reconcile_interval_s: float = 0.5
    health_timeout_s: float = 2.0
    probe_timeout_s: float = 120.0  # the first request of a cold engine can be slow
    start_timeout_s: float = 900.0  # process start to ready (model load, warm-up)
    liveness_interval_s: float = 1.0
    restart_backoff_initial_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    stop_grace_s: float = 15.0
    router_wait_s: float = 10.0  # a stopping replica waits this long at most for every router to drop it
    liveness: LivenessConfig = LivenessConfig()  # MODELPLANE_LIVENESS_*: idle probe 30 s, hung after 60 s
    write_retry_s: float = 60.0  # keep retrying a status write this long through a locked database


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct free ports: each socket stays bound until all are chosen, so the kernel
    cannot hand the same port out twice (``free_port`` called ``count`` times can)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def kill_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``, reap it, and kill any child
    that had left the group (engine workers)."""
    try:  # before the parent is reaped: afterwards its orphans belong to init
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


class ManagedReplica:
    """One replica's life: start, get ready, stay alive, restart — on its own thread."""

    def __init__(self, replica_id: str, revision: RevisionRow, runtime: ReplicaRuntime, engine: Engine,
                 logs_dir: Path, config: SupervisorConfig, mounts: ImageMounts | None = None,
                 pool: WarmPool | None = None) -> None:
        self.replica_id = replica_id
        self.revision_id = revision.id
        self.model_dir = Path(revision.model_dir)
        self.runtime_config = RuntimeConfig(model_name=revision.endpoint, **revision.runtime_config)
        self.runtime = runtime
        self._engine = engine
        self._log_path = logs_dir / f"{replica_id}.log"
        self._life_offset = 0
        self._config = config
        self._stop = threading.Event()
        self._process_lock = threading.Lock()  # stop() and a (re)start never interleave
        self._process: subprocess.Popen | AdoptedProcess | None = None
        self._adopted: AdoptedProcess | None = None
        self.port = 0
        self.restarts = 0
        self._thread = threading.Thread(target=self._run, name=f"replica-{replica_id}", daemon=True)
        # A revision with a serving image starts from its mounted layers (images.mounts); without
        # mounts (images off, or no FUSE here) it starts from the model directory in place.
        self.image = ImageRef.from_json(revision.image) if revision.image else None
        self._mounts = mounts if self.image is not None else None
        self._mounted: MountedImage | None = None
        self._pool = pool  # pre-started runtime processes; None: every start is cold
        # a one-off (the cost sweep's benchmark) may take a warm process but keeps none warm: the
        # replicas that serve run from the image's environment, not the one it measures from
        self._keep_warm = not (revision.details or {}).get(ONE_OFF, False)
        self._warm_start = False

    def adopt(self, process: AdoptedProcess, port: int, restarts: int) -> None:
        """Before :meth:`start`: watch this running, ready process as the replica's first life
        (and count it as a user of the image mounts it reads, which the previous supervisor left)."""
        self._adopted, self.port, self.restarts = process, port, restarts
        if self._mounts is not None:
            self._mounted = self._mounts.acquire(self.image)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._process_lock:
            self._stop.set()
            process = self._process
        stopping_since = utc_now()
        # out of the routers' table before the process goes; a database that cannot take the
        # write within router_wait_s cannot tell the routers either, so the stop goes on
        recorded = self._write("stopping", None, retry_s=self._config.router_wait_s)
        if process is not None:
            # every live router drops it first (a request it still sends is not refused at the socket)
            deadline = time.monotonic() + self._config.router_wait_s
            while recorded and time.monotonic() < deadline and self._routers_lag(stopping_since):
                time.sleep(0.1)
            kill_group(process, self._config.stop_grace_s)
        self._thread.join(timeout=self._config.stop_grace_s + 15)
        self._write("stopped", None)

    def abandon(self) -> None:
        """Stop the process of a replica whose watcher is taken for gone, and keep that watcher, should it
        still be running, from starting the process again (it would run on, unwatched, beside the new one)."""
        with self._process_lock:
            self._stop.set()
            process = self._process
        if process is not None and process.poll() is None:
            kill_group(process, self._config.stop_grace_s)

    @property
    def watching(self) -> bool:
        """False once the watcher thread is gone without a stop (the supervisor replaces it)."""
        return self._stop.is_set() or self._thread.is_alive()

    @property
    def url(self) -> str:
        return f"http://{self._config.host}:{self.port}"

    # -- the replica's life ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._lives()
        finally:
            if self._mounted is not None:
                python = os.path.abspath(self._mounted.python)
                if self._mounts.release(self.image) and self._pool is not None:
                    self._pool.forget(PoolKey(self.runtime.name, python))  # its zygotes ran from the mount
                self._mounted = None

    def _lives(self) -> None:
        while not self._stop.is_set():
            try:
                error = self._one_life()
            except Exception as exc:  # noqa: BLE001 - this thread is the replica's only watcher
                log.exception("replica %s: watcher error", self.replica_id)
                error = f"watcher error: {type(exc).__name__}: {exc}"
            if self._stop.is_set():
                return
            self.restarts += 1
            delay_s = restart_delay_s(self.restarts, self._config.restart_backoff_initial_s,
                                      self._config.restart_backoff_max_s)
            log.warning("replica %s: %s; restart %d in %.0f s", self.replica_id, error, self.restarts, delay_s)
            self._write("unhealthy", error)
            self._stop.wait(delay_s)

    def _one_life(self) -> str:
        if self._adopted is not None:
            return self._adopted_life()
        self.port = free_port(self._config.host)
        started = time.monotonic()
        launch = self._launch()
        # a fresh mount's fetches (index, prefetch) are part of this start; a shared one's are not
        fetched_before = self._mounts.fetch_stats(self.image) if self._mounted and not self._mounted.mount_s else {}
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self._life_offset = log_size(self._log_path)  # where this life's output begins
        with self._process_lock:
            if self._stop.is_set():
                return "stopped"
            self._process = self._start_process(launch)
        error = "stopped"
        try:
            self._write("starting", None)
            error = self._wait_ready()
            if error is None and not self._stop.is_set():
                if self._mounted is not None:
                    self._record_cold_start(time.monotonic() - started, fetched_before)
                self._write("ready", None)
                error = self._stay_alive()
            return error or "stopped"
        finally:
            if not self._stop.is_set():
                self._write("unhealthy", error)  # out of the router's table before the process goes
                kill_group(self._process, grace_s=5.0)

    def _start_process(self, launch: ReplicaLaunch) -> subprocess.Popen:
        """A warm runtime process from the pool where one fits, else a cold one (own session, output to the log)."""
        if self._pool is not None:
            started = self._pool.start(self.runtime.name, launch, self._log_path, keep_warm=self._keep_warm)
            self._warm_start = started.warm
            if not started.warm:
                log.info("replica %s: cold start (%s)", self.replica_id, started.reason)
            return started.process
        with self._log_path.open("ab") as log_file:
            return subprocess.Popen(launch.argv, env=replica_environment(launch.env), stdout=log_file,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def _launch(self) -> ReplicaLaunch:
        """The runtime's launch: from the mounted image where the revision has one and it mounts."""
        if self._mounts is not None and self._mounted is None:
            try:
                self._mounted = self._mounts.acquire(self.image)
            except Exception as exc:  # noqa: BLE001 - serving in place beats not serving
                log.warning("replica %s: image %s did not mount (%s); starting from %s in place",
                            self.replica_id, self.image.reference, exc, self.model_dir)
                self._mounts = None
        if self._mounted is None:
            return self.runtime.command(self.model_dir, self._config.host, self.port, self.runtime_config)
        launch = self.runtime.command(self._mounted.model_dir, self._config.host, self.port, self.runtime_config)
        return launch_from_image(launch, self._mounted, REPO_ROOT)

    def _record_cold_start(self, total_s: float, fetched_before: dict) -> None:
        """How this start split into image, weights and engine (revision details: served_endpoint reports it)."""
        split = cold_start_split(total_s, self._mounted.mount_s, fetched_before, self._mounts.fetch_stats(self.image),
                                 sum(layer.data_bytes for layer in self.image.layers), self._mounted.mode,
                                 self._warm_start)
        self._mounted = replace(self._mounted, mount_s=0.0)  # a restart finds the layers mounted
        self._mounts.ready(self.image)
        try:
            RevisionStore(self._engine).add_details(self.revision_id, cold_start=split,
                                                    started_from=self.image.reference)
        except (KeyError, OperationalError) as exc:
            log.warning("replica %s: cold start not recorded: %s", self.replica_id, exc)

    def _adopted_life(self) -> str:
        """The process a previous supervisor started: already ready, so straight to watching it."""
        with self._process_lock:
            self._process, self._adopted = self._adopted, None
        error = "stopped"
        try:
            self._write("ready", None)
            error = self._stay_alive()
            return error
        finally:
            if not self._stop.is_set():
                self._write("unhealthy", error)
                kill_group(self._process, grace_s=5.0)

    def _wait_ready(self) -> str | None:
        deadline = time.monotonic() + self._config.start_timeout_s
        probe = self.runtime.probe_request(self.model_dir, self.runtime_config)
        with httpx.Client(timeout=self._config.health_timeout_s, verify=tls_context()) as http:
            while time.monotonic() < deadline and not self._stop.is_set():
                if self._process.poll() is not None:
                    said = log_tail(self._log_path, self._life_offset)
                    return (f"exited with code {self._process.returncode} while starting"
                            + (f": {said}" if said else "") + f" (log: {self._log_path})")
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        if probe is None:  # nothing says what the model takes: loaded is ready
                            return None
                        answer = http.post(f"{self.url}{probe.path}", json=probe.json,
                                           timeout=self._config.probe_timeout_s)
                        if answer.is_success:
                            return None
                        return f"warm-up request answered {answer.status_code}: {answer.text[:200]}"
                except httpx.HTTPError:
                    pass
                self._stop.wait(0.5)
        return "stopped" if self._stop.is_set() else f"not ready after {self._config.start_timeout_s:.0f} s"

    def _stay_alive(self) -> str:
        """Watch forward progress (``serving.runtime.liveness``) until the replica dies or hangs."""
        state, liveness = LivenessState(), self._config.liveness
        probe = self.runtime.probe_request(self.model_dir, self.runtime_config)
        unanswered_since_s: float | None = None
        with httpx.Client(timeout=self._config.health_timeout_s, verify=tls_context()) as http:
            while not self._stop.wait(self._config.liveness_interval_s):
                if self._process.poll() is not None:
                    return f"exited with code {self._process.returncode}"
                now_s = time.monotonic()
                try:
                    progress = self.runtime.progress(http.get(f"{self.url}/metrics").text)
                except httpx.HTTPError as exc:
                    # A replica too busy to answer a scrape for as long as a hang counts as hung.
                    unanswered_since_s = unanswered_since_s or now_s
                    if now_s - unanswered_since_s >= liveness.unanswered_after_s:
                        return f"hung: /metrics unanswered for {liveness.unanswered_after_s:.0f} s ({exc})"
                    continue
                unanswered_since_s = None
                verdict, state = decide(progress, state, now_s, liveness, can_probe=probe is not None)
                if verdict is Verdict.HUNG:
                    return "hung: work outstanding with no request completing"
                if verdict is Verdict.PROBE:
                    threading.Thread(target=self._send_probe, args=(probe,), daemon=True).start()
        return "stopped"

    def _send_probe(self, probe) -> None:
        try:
            httpx.post(f"{self.url}{probe.path}", json=probe.json, timeout=self._config.probe_timeout_s,
                       verify=tls_context())
        except httpx.HTTPError:
            pass  # no completion shows up in /metrics, and liveness sees that

    def _routers_lag(self, since) -> bool:
        """Whether a live router may still hold the table from before ``since``; False when the
        database cannot say (its routers cannot read it either)."""
        try:
            return RouterStore(self._engine).lagging(since)
        except OperationalError:
            log.warning("replica %s: database unreachable; not waiting for the routers", self.replica_id)
            return False

    def _write(self, state: str, error: str | None, retry_s: float | None = None) -> bool:
        """Record the replica's state, retrying through a locked database for ``retry_s`` (default
        ``write_retry_s``); whether it was recorded."""
        deadline = time.monotonic() + (self._config.write_retry_s if retry_s is None else retry_s)
        while True:
            try:
                self._write_once(state, error)
                return True
            except OperationalError:
                if time.monotonic() >= deadline:
                    log.exception("replica %s: could not record state %s", self.replica_id, state)
                    return False
                log.warning("replica %s: database busy recording state %s; retrying", self.replica_id, state)
                time.sleep(0.5)

    def _write_once(self, state: str, error: str | None) -> None:
        with Session(self._engine) as session, session.begin():
            row = session.get(ReplicaRow, self.replica_id)
            if row is None and self._stop.is_set() and state != "stopped":
                return  # a late write from a stopping replica must not bring its deleted row back
            if row is None:
                row = ReplicaRow(id=self.replica_id, revision_id=self.revision_id)
                session.add(row)
            row.host, row.port, row.state = self._config.host, self.port, state
            row.pid = None if self._process is None else self._process.pid
            # a restart keeps the reason for it until the replica is ready again
            kept = row.last_error if state == "starting" and error is None else error
            row.restarts, row.last_error, row.updated_at = self.restarts, kept, utc_now()
