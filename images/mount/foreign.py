"""A layer mount another process set up: a supervisor that was killed left it, and replicas
still read from it.

Mount daemons run in sessions of their own, so they outlive a supervisor that is killed, and
the replicas reading through them keep serving. The next supervisor adopts such a mount
(:class:`ForeignMount`) instead of pulling it from under them: it finds the daemon by its
command line, can ask it for stats and the background fill, and tears it down in the usual
order (squashfs, then the loop device, then the FUSE file) once no replica uses it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import psutil

from images.mount.system import loop_backing_file, mounts, unmount


def _daemon_serving(mountpoint: str) -> psutil.Process | None:
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if "images.mount.daemon" in cmdline and mountpoint in cmdline:
            return process
    return None


class ForeignMount:
    """The mount at ``target`` (kernel: squashfs on a loop device on a FUSE file; or a FUSE directory)."""

    def __init__(self, target: Path) -> None:
        self.target = Path(target)
        entry = next((m for m in mounts() if m.mount_point == os.path.realpath(target)), None)
        self.loop_device = entry.source if entry is not None and entry.source.startswith("/dev/loop") else None
        backing = loop_backing_file(self.loop_device) if self.loop_device else None
        self.fuse_dir = Path(backing).parent if backing else self.target  # where the daemon's FUSE mount is
        self._daemon = _daemon_serving(str(self.fuse_dir))

    def running(self) -> bool:
        return self._daemon is not None and self._daemon.is_running()

    def send_signal(self, sig: int) -> None:
        if self.running():
            with contextlib.suppress(psutil.Error):
                self._daemon.send_signal(sig)

    def request_stats(self) -> None:
        self.send_signal(signal.SIGUSR1)

    def close(self) -> None:
        if self.loop_device is not None:
            unmount(self.target, fuse=False, busy_grace_s=2.0)
            subprocess.run(["losetup", "-d", self.loop_device], capture_output=True, check=False)
        unmount(self.fuse_dir, fuse=True, busy_grace_s=2.0)  # its daemon then exits by itself
        if self._daemon is not None:
            with contextlib.suppress(psutil.Error):
                self._daemon.wait(timeout=10)
