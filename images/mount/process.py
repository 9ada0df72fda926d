"""Start a FUSE daemon as a child process, wait until its mount is visible, and stop it.

The parent owns the child's whole life: :meth:`FuseProcess.start` returns only once the
kernel lists the mount and answers a ``stat`` through it (or raises with the tail of the
child's stderr, the child gone), and :meth:`FuseProcess.stop` unmounts, waits for the child
and reaps it. Stopping converges on "nothing mounted, no child" from wherever it starts: a
mount still busy after ``busy_grace_s`` is detached lazily, a child that does not exit
after ``stop_timeout_s`` gets SIGTERM and then SIGKILL, and a mount the dead child left
behind is unmounted afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import images
from images.mount.system import MountError, mounted_at, unmount

PROJECT_ROOT = Path(images.__file__).resolve().parent.parent  # what the child needs on sys.path
STDERR_TAIL_BYTES = 4000


@dataclass(frozen=True)
class FuseProcessConfig:
    """How long to wait for a daemon. ``allow_other`` None: allowed when running as root (a
    root daemon's mount is for the serving process, which may run as another user)."""

    start_timeout_s: float = 60.0  # a registry source fetches its index (and prefetch) first
    stop_timeout_s: float = 10.0  # after the unmount, before SIGTERM
    busy_grace_s: float = 2.0  # a busy unmount is retried this long before a lazy detach
    poll_interval_s: float = 0.02
    allow_other: bool | None = None

    def __post_init__(self) -> None:
        if min(self.start_timeout_s, self.stop_timeout_s, self.busy_grace_s) < 0 or self.poll_interval_s <= 0:
            raise ValueError(f"timeouts must be >= 0 and the poll interval > 0: {self}")


class FuseProcess:
    """A running FUSE daemon (``python -m images.mount.daemon``) and its mountpoint."""

    def __init__(self, child: subprocess.Popen, mountpoint: Path, mode: str, stderr_path: Path,
                 config: FuseProcessConfig) -> None:
        self.child = child
        self.mountpoint = mountpoint
        self.mode = mode
        self.config = config
        self.lazily_detached = False  # set by stop() when the mount was busy
        self._stderr_path = stderr_path

    @property
    def pid(self) -> int:
        return self.child.pid

    @classmethod
    def start(cls, mode: str, source_spec: dict, mountpoint: str | Path, *,
              config: FuseProcessConfig = FuseProcessConfig(), stats_file: Path | None = None) -> FuseProcess:
        """Mount ``source_spec`` at ``mountpoint`` (``mode`` "file" or "dir"); returns once visible."""
        if mode not in ("file", "dir"):
            raise ValueError(f"mode must be 'file' or 'dir', not {mode!r}")
        mountpoint = Path(mountpoint)
        if not mountpoint.is_dir():
            raise MountError(f"mountpoint {mountpoint} is not a directory")
        if mounted_at(mountpoint):
            raise MountError(f"something is already mounted at {mountpoint}")
        allow_other = os.geteuid() == 0 if config.allow_other is None else config.allow_other
        argv = [sys.executable, "-m", "images.mount.daemon", "--mode", mode, "--source-spec", json.dumps(source_spec),
                "--mountpoint", str(mountpoint)]
        argv += ["--stats-file", str(stats_file)] if stats_file is not None else []
        argv += ["--allow-other"] if allow_other else []
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
        handle, stderr_name = tempfile.mkstemp(prefix="modelplane-fuse-", suffix=".log")
        try:
            # A session of its own: a signal to the parent's process group (Ctrl-C, `modelplane up`
            # stopping its services) must not end the daemon before the parent has unmounted what
            # sits on it (squashfs, then the loop device); the parent stops it last.
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=handle, env=env,
                                     start_new_session=True)
        finally:
            os.close(handle)
        process = cls(child, mountpoint, mode, Path(stderr_name), config)
        try:
            process._wait_until_mounted()
        except BaseException:
            process.stop()
            raise
        return process

    def _wait_until_mounted(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            code = self.child.poll()
            if code is not None:
                raise MountError(f"the FUSE daemon exited with {code} before mounting {self.mountpoint}:\n"
                                 f"{self.stderr_tail()}")
            if mounted_at(self.mountpoint, "fuse"):
                os.stat(self.mountpoint)  # a round trip: libfuse has answered INIT
                return
            if time.monotonic() >= deadline:
                raise MountError(f"{self.mountpoint} was not mounted within {self.config.start_timeout_s} s:\n"
                                 f"{self.stderr_tail()}")
            time.sleep(self.config.poll_interval_s)

    def stderr_tail(self) -> str:
        try:
            with open(self._stderr_path, "rb") as log:
                log.seek(max(0, os.fstat(log.fileno()).st_size - STDERR_TAIL_BYTES))
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def request_stats(self) -> None:
        """Ask the daemon to write its stats file now (SIGUSR1)."""
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGUSR1)

    def running(self) -> bool:
        return self.child.poll() is None

    def stop(self) -> None:
        """Unmount and reap the child; safe to call again. Raises MountError only when a
        mount is left behind after everything was tried."""
        try:
            self.lazily_detached = unmount(self.mountpoint, fuse=True, busy_grace_s=self.config.busy_grace_s) \
                or self.lazily_detached
        except MountError:
            pass  # killing the daemon below ends its mount too; checked again afterwards
        self._reap()
        if mounted_at(self.mountpoint, "fuse"):  # the daemon died before it could unmount
            self.lazily_detached = unmount(self.mountpoint, fuse=True, busy_grace_s=0) or self.lazily_detached
        self._stderr_path.unlink(missing_ok=True)

    def _reap(self) -> None:
        for next_signal, wait_s in ((None, self.config.stop_timeout_s), (signal.SIGTERM, 2.0), (signal.SIGKILL, None)):
            if next_signal is not None and self.child.poll() is None:
                self.child.send_signal(next_signal)
            try:
                self.child.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> FuseProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
