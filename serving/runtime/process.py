"""Starting a server process for a while: a free port, its own session, health, and a clean stop.

Used where modelplane runs an engine outside the supervisor for a bounded job (the eval
gate, benchmarks): start it in a new session so that every child (vLLM's engine core and
workers) can be found and stopped, wait for ``GET /health``, and on the way out stop the
whole session, SIGTERM first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from serving.tls import tls_context


# What control-plane processes hold and a replica must not: a replica runs model code, and a
# model is whatever was registered. It gets none of these from the environment it starts in.
CONTROL_PLANE_ONLY_ENV = frozenset({
    "MODELPLANE_DATABASE_URL",  # may hold the PostgreSQL password
    "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY",  # decrypts the webhook signing secret MLflow stores
    "PGPASSWORD", "PGPASSFILE", "DAGSTER_PG_PASSWORD",
})


def replica_environment(launch_env: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a replica process starts with: ``base`` (this process's) minus the
    control plane's secrets, plus what the runtime asked for.

    >>> replica_environment({"OMP_NUM_THREADS": "2"}, {"PATH": "/bin", "MODELPLANE_DATABASE_URL": "postgresql://…"})
    {'PATH': '/bin', 'OMP_NUM_THREADS': '2'}
    """
    base = os.environ if base is None else base
    return {**{k: v for k, v in base.items() if k not in CONTROL_PLANE_ONLY_ENV}, **launch_env}


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def default_stop_signals() -> None:
    """``preexec_fn`` for a replica: its stop signals at their defaults, whatever its starter ignores.

    An ignored signal stays ignored across exec, so a replica started by a process that ignores
    SIGTERM (a CI runner's, a ``nohup``-like wrapper's) would ignore it too and every stop would
    wait out the grace and end in SIGKILL, with no drain. Runs in the child between fork and
    exec: only ``sigaction`` calls, nothing that takes a lock.
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_server_session(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever of its session is left.

    vLLM's engine core and workers are spawned children in the server's session; a crash
    of the front end must not leave them holding cores and memory.
    """
    import psutil

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    leftovers = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(p.pid) == proc.pid:
                leftovers.append(p)
    for p in leftovers:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(leftovers, timeout=10)


@contextlib.contextmanager
def running_server(argv: list[str], env: dict[str, str], port: int, log_path: Path,
                   startup_timeout_s: float = 300.0, cwd: Path | None = None) -> Iterator[tuple[str, float]]:
    """Start a server in its own session, wait for ``GET /health``; yield (base URL, startup seconds)."""
    import httpx

    log_path.parent.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=replica_environment(env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=cwd)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was healthy; see {log_path}:\n"
                                   + log_path.read_text()[-3000:])
            if time.monotonic() - started > startup_timeout_s:
                raise TimeoutError(f"server not healthy after {startup_timeout_s} s; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2, trust_env=False, verify=tls_context()).status_code == 200:
                    break
            time.sleep(0.5)
        yield base, time.monotonic() - started
    finally:
        stop_server_session(proc)


@contextlib.contextmanager
def exclusive(lock_path: Path, log: Callable[[str], None], what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (``flock``: released when the holder exits, however it
    exits), saying so when another process holds it. Builders of one content-keyed entry (an
    environment layer, a quantized checkpoint, a gate evaluation) take turns through it, so the
    second finds what the first made instead of making it again."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process making {what}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
