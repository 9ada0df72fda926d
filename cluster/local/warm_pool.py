"""Runtime processes started ahead of need, so that a new replica skips its interpreter and engine imports.

A :class:`WarmPool` keeps ``size_per_kind`` ready zygotes (:mod:`serving.runtime.zygote`) per
:class:`PoolKey` (runtime kind + python executable: a replica may run from a mounted image's
venv). :meth:`WarmPool.start` is what the supervisor calls instead of ``subprocess.Popen``: it
hands the replica to a ready zygote that fits it, else starts it cold, exactly as the
supervisor did (same argv, :func:`~serving.runtime.process.replica_environment`, log, new
session, stop signals at their defaults), and says which and why. Either way the caller gets a ``subprocess.Popen`` that is
the leader of its own session, so ``kill_group`` stops the replica and all its children.

Costs, measured on this 2-core machine (``benchmarks/engine_startup.py``): an idle vLLM
zygote holds 720-760 MiB RSS (480-620 MiB of it its own, USS: torch, transformers and vLLM
imported) after 8-13 s of importing; a pyfunc zygote 170-186 MiB RSS (111 MiB USS: MLflow,
pandas, numpy) after 1.5-2 s. A warm vLLM replica answered its first request after 29.2 s
against 40.2 s cold (medians of 3). A kind costs nothing until it is used: a key is warmed
only after its first replica start (or an explicit :meth:`WarmPool.warm`), and refills wait
``refill_delay_s`` after a start, so that a zygote's imports (10-14 CPU-seconds for vLLM) are
not taken from the cores of the replica that is starting, whose engine core imports
vLLM again at the same moment.

The pool is a level-triggered reconciler: :func:`~cluster.local.warm_pool_plan.plan` compares the zygotes there are with the
zygotes wanted and says which to start and which to stop; :meth:`WarmPool.reconcile` gathers
the facts, calls it and applies the result, from a background thread every ``poll_interval_s``
(or from a test). A zygote that dies while idle, one that does not become ready within
``start_timeout_s``, and one that no longer fits the key's environment (the last replica
start's) are replaced; repeated failures to start back off exponentially.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autoscale.clock import Clock, MonotonicClock
from cluster.local.warm_pool_plan import (EXITED_BEFORE_READY, NOT_READY, KeyState, LaunchLike, PoolKey, PoolPlan,
                                          WarmPoolConfig, ZygoteView, after_failure, plan)
from serving.runtime.base import ReplicaLaunch
from serving.runtime.process import default_stop_signals, replica_environment
from serving.runtime.zygote import KINDS, Assignment, ZygoteFacts, ZygoteKind, refusal

log = logging.getLogger("modelplane.warm_pool")


class AssignmentRefused(Exception):
    """The zygote cannot become this replica exactly as a cold process would; start it cold."""


@dataclass(frozen=True)
class Started:
    """A replica process, and how it was started (``reason``: why cold, None when warm)."""

    process: subprocess.Popen
    warm: bool
    reason: str | None = None


@dataclass
class WarmProcess:
    """One zygote: its process (the replica's, once assigned) and its end of the control socket."""

    id: int
    key: PoolKey
    process: subprocess.Popen
    control: socket.socket
    preload_log: Path
    started_s: float
    facts: ZygoteFacts | None = None
    assign_timeout_s: float = 10.0
    _buffer: bytes = field(default=b"", repr=False)

    def refusal(self, launch: LaunchLike, cwd: str | Path | None = None) -> str | None:
        """Why this zygote would refuse ``launch``; None when it would become it."""
        if self.facts is None:
            return "the zygote is not ready"
        return refusal(self._assignment(launch, "", cwd), self.facts)

    def assign(self, launch: LaunchLike, log_path: Path, cwd: str | Path | None = None) -> subprocess.Popen:
        """Make this zygote the replica ``launch`` describes; its own Popen (a session leader) comes back.

        Raises :class:`AssignmentRefused` (the zygote is stopped) when it cannot become that
        replica exactly as a cold ``Popen`` would have started it.
        """
        log_path = Path(log_path)
        assignment = self._assignment(launch, str(log_path), cwd)
        reason = "the zygote is not ready" if self.facts is None else refusal(assignment, self.facts)
        if reason is None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.control.setblocking(True)
                self.control.settimeout(self.assign_timeout_s)
                self.control.sendall(json.dumps(asdict(assignment)).encode() + b"\n")
                answer = self._read_line(blocking=True)
            except OSError as exc:
                answer = {"event": "refused", "reason": f"the zygote did not answer ({exc})"}
            if answer is None or answer.get("event") != "accepted":
                reason = (answer or {}).get("reason") or "the zygote exited or did not answer within assign_timeout_s"
        self.control.close()
        if reason is not None:
            self.kill()
            raise AssignmentRefused(reason)
        with contextlib.suppress(OSError):
            self.preload_log.unlink()  # the zygote copied it into the replica's log
        return self.process

    def kill(self) -> None:
        """SIGKILL the zygote's session and reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        with contextlib.suppress(OSError):
            self.control.close()
        with contextlib.suppress(OSError):
            self.preload_log.unlink()

    def poll_ready(self) -> bool:
        """Read the zygote's ready message if it has arrived (never blocks)."""
        if self.facts is None:
            message = self._read_line(blocking=False)
            if message is not None and message.get("event") == "ready":
                self.facts = ZygoteFacts.from_json(message)
        return self.facts is not None

    def _assignment(self, launch: LaunchLike, log_path: str, cwd: str | Path | None) -> Assignment:
        affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return Assignment(argv=list(launch.argv), env=replica_environment(dict(launch.env)),
                          cwd=os.path.abspath(cwd if cwd is not None else os.getcwd()), log_path=log_path,
                          cpu_affinity=affinity)

    def _read_line(self, blocking: bool) -> dict | None:
        while b"\n" not in self._buffer:
            try:
                chunk = self.control.recv(1 << 20) if blocking else self.control.recv(1 << 20, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                return None
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)


def cold_start(launch: LaunchLike, log_path: Path, cwd: str | Path | None = None) -> subprocess.Popen:
    """The replica started as the supervisor starts one: its own session, output appended to its log."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        return subprocess.Popen(launch.argv, env=replica_environment(dict(launch.env)), stdout=log_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd,
                                preexec_fn=default_stop_signals)


# ---- the pool --------------------------------------------------------------------------------

class WarmPool:
    """Ready zygotes per key, refilled in the background; :meth:`start` replaces ``subprocess.Popen``.

    Thread-safe: replica watcher threads call :meth:`start` while the reconcile thread runs.
    ``background=False`` leaves reconciling to the caller (:meth:`reconcile`), for tests.
    """

    def __init__(self, config: WarmPoolConfig = WarmPoolConfig(), clock: Clock | None = None,
                 background: bool = True, kinds: Mapping[str, ZygoteKind] = KINDS) -> None:
        """``kinds``: what a zygote of each runtime kind preloads and serves (tests add their own)."""
        self.config = config
        self.kinds = dict(kinds)
        self._clock = clock or MonotonicClock()
        self._cwd = os.path.abspath(config.cwd) if config.cwd is not None else os.getcwd()
        self._owned_log_dir = None if config.log_dir is not None else tempfile.TemporaryDirectory(prefix="zygotes-")
        self._log_dir = Path(config.log_dir) if config.log_dir is not None else Path(self._owned_log_dir.name)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._wanted: dict[PoolKey, KeyState] = {}
        self._zygotes: dict[int, WarmProcess] = {}
        self._next_id = 1
        self._closed = threading.Event()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="warm-pool", daemon=True)
            self._thread.start()

    # -- what callers use ---------------------------------------------------------------------
    def start(self, kind: str, launch: LaunchLike, log_path: Path, cwd: str | Path | None = None,
              keep_warm: bool = True) -> Started:
        """Start a replica on a fitting warm zygote of (kind, launch's python), else cold.

        With ``keep_warm`` (the default), also records this launch's environment as the key's
        profile: the key is warmed (after ``refill_delay_s``) for replicas like this one. Without
        it (a one-off replica), the key is warmed only if other replicas asked for it.
        """
        if kind not in self.kinds:
            return Started(cold_start(launch, log_path, cwd), warm=False, reason=f"no zygote kind {kind!r}")
        key = PoolKey.for_launch(kind, launch)
        if keep_warm:
            self._want(key, launch.env)
        with self._lock:
            ready = [z for z in self._zygotes.values() if z.key == key and z.facts is not None
                     and z.process.poll() is None]
            reasons = {z.id: z.refusal(launch, cwd) for z in ready}
            chosen = next((z for z in ready if reasons[z.id] is None), None)
            if chosen is not None:
                del self._zygotes[chosen.id]
        if chosen is None:
            reason = next(iter(reasons.values()), None) or "no warm zygote ready"
            return Started(cold_start(launch, log_path, cwd), warm=False, reason=reason)
        try:
            return Started(chosen.assign(launch, log_path, cwd), warm=True)
        except AssignmentRefused as exc:
            log.warning("zygote %d refused a %s replica: %s; starting it cold", chosen.process.pid, kind, exc)
            return Started(cold_start(launch, log_path, cwd), warm=False, reason=str(exc))

    def take(self, key: PoolKey) -> WarmProcess | None:
        """A ready zygote of ``key``, now the caller's (assign or kill it); None when none is ready."""
        with self._lock:
            chosen = next((z for z in self._zygotes.values() if z.key == key and z.facts is not None
                           and z.process.poll() is None), None)
            if chosen is None:
                return None
            del self._zygotes[chosen.id]
            state = self._wanted.get(key)
            if state is not None:
                self._wanted[key] = KeyState(state.profile_env, self._clock.now_s() + self.config.refill_delay_s,
                                             state.failures)
            return chosen

    def forget(self, key: PoolKey) -> None:
        """Stop keeping ``key`` warm and kill its idle zygotes: its interpreter is going away
        (the image it runs from was unmounted; a zygote mapped from it would die of SIGBUS
        the moment it ran)."""
        with self._lock:
            self._wanted.pop(key, None)
            stale = [z for z in self._zygotes.values() if z.key == key]
            for zygote in stale:
                del self._zygotes[zygote.id]
        for zygote in stale:
            zygote.kill()

    def warm(self, key: PoolKey, launch_env: Mapping[str, str] | None = None) -> None:
        """Keep ``key`` warm from now on, for replicas whose launch adds ``launch_env`` (default: nothing)."""
        self._want(key, launch_env or {}, now=True)

    def reconcile(self) -> PoolPlan:
        """One pass: read ready messages, compare, start and stop zygotes. Returns what it decided."""
        with self._lock:
            now_s = self._clock.now_s()
            views = []
            for z in self._zygotes.values():
                alive = z.process.poll() is None
                ready = z.poll_ready() if alive else z.facts is not None
                state = self._wanted.get(z.key)
                fits = not ready or state is None or z.refusal(_profile_launch(z, state.profile_env)) is None
                views.append(ZygoteView(z.id, z.key, z.started_s, alive, ready, fits))
                if ready and state is not None and state.failures:
                    self._wanted[z.key] = KeyState(state.profile_env, state.not_before_s, 0)
            decided = plan(self._wanted, views, now_s, self.config)
            for zygote_id, why in decided.stop:
                zygote = self._zygotes.pop(zygote_id)
                if why in (EXITED_BEFORE_READY, NOT_READY) and zygote.key in self._wanted:
                    self._wanted[zygote.key] = after_failure(self._wanted[zygote.key], now_s, self.config)
                    log.warning("%s zygote %d %s; its output ended:\n%s", zygote.key.kind, zygote.process.pid,
                                why, _tail(zygote.preload_log))
                else:
                    log.info("stopping %s zygote %d: %s", zygote.key.kind, zygote.process.pid, why)
                zygote.kill()
            for key in decided.start:
                if self._closed.is_set():
                    break
                self._spawn(key, self._wanted[key].profile_env, now_s)
            return decided

    def idle(self) -> dict[PoolKey, list[int]]:
        """Pids of the zygotes held now (ready or starting), per key."""
        with self._lock:
            held: dict[PoolKey, list[int]] = {}
            for z in self._zygotes.values():
                held.setdefault(z.key, []).append(z.process.pid)
            return held

    def close(self) -> None:
        """Stop the loop, kill every zygote not handed out, and wait for them: no process is left."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            zygotes, self._zygotes = list(self._zygotes.values()), {}
            self._wanted.clear()
        for zygote in zygotes:
            zygote.kill()
        if self._owned_log_dir is not None:
            self._owned_log_dir.cleanup()

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside ---------------------------------------------------------------------------------
    def _want(self, key: PoolKey, launch_env: Mapping[str, str], now: bool = False) -> None:
        """The key's profile is the latest launch's; its next zygote starts now, or after the refill delay."""
        now_s = self._clock.now_s()
        with self._lock:
            state = self._wanted.get(key, KeyState(dict(launch_env)))
            not_before_s = now_s if now else max(state.not_before_s, now_s + self.config.refill_delay_s)
            self._wanted[key] = KeyState(dict(launch_env), not_before_s, state.failures)

    def _spawn(self, key: PoolKey, launch_env: Mapping[str, str], now_s: float) -> None:
        zygote_id, self._next_id = self._next_id, self._next_id + 1
        kind = self.kinds[key.kind]
        preload_log = self._log_dir / f"zygote-{key.kind}-{zygote_id}.log"
        ours, theirs = socket.socketpair()
        try:
            with preload_log.open("wb") as output:
                process = subprocess.Popen(
                    [key.python, "-m", "serving.runtime.zygote", "--kind", key.kind, "--control",
                     f"fd:{theirs.fileno()}", "--preload-log", str(preload_log), "--serves", ",".join(kind.serves),
                     "--preload", ",".join(kind.preload)],
                    env=replica_environment(dict(launch_env)), cwd=self._cwd, stdin=subprocess.DEVNULL, stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True, pass_fds=(theirs.fileno(),), preexec_fn=default_stop_signals)
        except OSError as exc:  # e.g. the python is gone: a failure like any other, backed off
            log.warning("cannot start a %s zygote with %s: %s", key.kind, key.python, exc)
            ours.close()
            self._wanted[key] = after_failure(self._wanted[key], now_s, self.config)
            return
        finally:
            theirs.close()
        self._zygotes[zygote_id] = WarmProcess(zygote_id, key, process, ours, preload_log, now_s,
                                               assign_timeout_s=self.config.assign_timeout_s)
        log.info("started %s zygote %d (%s)", key.kind, process.pid, key.python)

    def _loop(self) -> None:
        while not self._closed.wait(self.config.poll_interval_s):
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 - the pool is an optimisation: it must not take the supervisor down
                log.exception("warm pool reconcile failed; retrying")


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no output)"


def _profile_launch(zygote: WarmProcess, profile_env: Mapping[str, str]) -> ReplicaLaunch:
    """A launch with the key's profile environment, to ask a ready zygote whether it still fits."""
    return ReplicaLaunch(argv=[zygote.key.python, "-m", zygote.facts.serves[0]], env=dict(profile_env))
