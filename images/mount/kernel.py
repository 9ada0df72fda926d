"""The kernel path: FUSE file, read-only loop device, the kernel's squashfs driver.

Set-up, each step undone by teardown in reverse:

1. the FUSE file daemon mounts ``<private dir>/image`` (:mod:`images.mount.fuse_file`);
2. ``losetup --read-only --find --show <private dir>/image`` attaches a loop device, and the
   exact ``/dev/loopN`` it printed is recorded: teardown detaches that one device, never
   ``losetup -D``, which would detach every other user's too;
3. ``mount -t squashfs -o ro,nodev,nosuid /dev/loopN <target>``.

Teardown runs every step whatever happened before it and whatever state set-up reached
(it looks at the mount table and the loop device's backing file rather than trusting
flags), so a failed set-up leaves nothing behind. A target still in use is detached lazily
after ``busy_grace_s``: the kernel then keeps the squashfs, the loop device (detached on its
last close) and the FUSE file alive until the last file is closed, the daemon is stopped,
and reads by whoever still holds a file fail with EIO rather than hang.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from images.mount.fuse_file import IMAGE_NAME
from images.mount.process import FuseProcess, FuseProcessConfig
from images.mount.system import MountError, attached_loop_devices, loop_backing_file, mounts, run_tool, unmount

MOUNT_OPTIONS = "ro,nodev,nosuid"


@dataclass(frozen=True)
class LoopMountConfig:
    """``private_root``: where the FUSE file's directory is made (None: the temp dir)."""

    fuse: FuseProcessConfig = field(default_factory=FuseProcessConfig)
    busy_grace_s: float = 2.0  # how long a busy target is retried before a lazy unmount
    private_root: str | None = None
    tool_timeout_s: float = 60.0  # losetup, mount: the superblock read may fetch from a registry


def attach_argv(image_file: Path) -> list[str]:
    """The losetup call that attaches ``image_file`` read-only and prints the device it took.

    >>> attach_argv(Path("/run/x/image"))
    ['losetup', '--read-only', '--find', '--show', '/run/x/image']
    """
    return ["losetup", "--read-only", "--find", "--show", str(image_file)]


def mount_argv(device: str, target: Path) -> list[str]:
    """The mount call: the kernel's squashfs, read-only, no device nodes, no set-uid.

    >>> mount_argv("/dev/loop3", Path("/srv/m"))
    ['mount', '-t', 'squashfs', '-o', 'ro,nodev,nosuid', '/dev/loop3', '/srv/m']
    """
    return ["mount", "-t", "squashfs", "-o", MOUNT_OPTIONS, device, str(target)]


class LoopMount:
    """An image mounted by the kernel at ``target``; :meth:`close` takes it all down."""

    def __init__(self, target: Path, config: LoopMountConfig) -> None:
        self.target = Path(target)
        self.config = config
        self.private_dir: Path | None = None
        self.fuse: FuseProcess | None = None
        self.loop_device: str | None = None
        self.lazily_detached = False

    @property
    def image_file(self) -> Path | None:
        return None if self.private_dir is None else self.private_dir / IMAGE_NAME

    @classmethod
    def open(cls, source_spec: dict, target: str | Path, *, config: LoopMountConfig = LoopMountConfig(),
             stats_file: Path | None = None) -> LoopMount:
        mount = cls(Path(target), config)
        try:
            mount._set_up(source_spec, stats_file)
        except BaseException as exc:
            try:
                mount.close()
            except MountError as cleanup:
                exc.add_note(f"and tearing down what was set up failed: {cleanup}")
            raise
        return mount

    def _set_up(self, source_spec: dict, stats_file: Path | None) -> None:
        if not self.target.is_dir():
            raise MountError(f"target {self.target} is not a directory")
        if self._target_mounted(any_source=True):
            raise MountError(f"something is already mounted at {self.target}")
        self.private_dir = Path(tempfile.mkdtemp(prefix="modelplane-image-", dir=self.config.private_root))
        os.chmod(self.private_dir, 0o700)
        # Only root, through the 0700 private dir, ever opens the raw image file.
        file_config = dataclasses.replace(self.config.fuse, allow_other=False)
        self.fuse = FuseProcess.start("file", source_spec, self.private_dir, config=file_config, stats_file=stats_file)
        self.loop_device = run_tool(attach_argv(self.image_file), "attaching a loop device",
                                    self.config.tool_timeout_s).strip()
        if not self.loop_device.startswith("/dev/loop"):
            raise MountError(f"losetup printed {self.loop_device!r}, not a loop device")
        run_tool(mount_argv(self.loop_device, self.target), f"mounting {self.loop_device} at {self.target}",
                 self.config.tool_timeout_s)

    def _target_mounted(self, any_source: bool = False) -> bool:
        real = os.path.realpath(self.target)
        return any(entry.mount_point == real and (any_source or entry.source == self.loop_device)
                   for entry in mounts())

    def _our_loop_devices(self) -> list[str]:
        """The loop devices bound to our FUSE file: the recorded one, and any that an attach
        cut short (a timed-out losetup) left unrecorded. Found by backing file, which lies in
        our private dir, so a device someone else uses is never among them."""
        if self.image_file is None:
            return []
        candidates = {self.loop_device} if self.loop_device else set()
        candidates |= {device for device, backing in attached_loop_devices().items()
                       if backing.startswith(str(self.image_file))}
        return sorted(device for device in candidates
                      if (loop_backing_file(device) or "").startswith(str(self.image_file)))

    def close(self) -> None:
        """Unmount the target, detach the loop device, stop the daemon, remove the private
        dir: each step tried whatever the others did; MountError lists what failed."""
        failures = []
        if self.loop_device and self._target_mounted():
            try:
                self.lazily_detached = unmount(self.target, fuse=False, busy_grace_s=self.config.busy_grace_s)
            except MountError as exc:
                failures.append(str(exc))
        for device in self._our_loop_devices():
            try:
                run_tool(["losetup", "--detach", device], f"detaching {device}")
            except MountError as exc:
                failures.append(str(exc))
        if self.fuse is not None:
            try:
                self.fuse.stop()
                self.lazily_detached = self.lazily_detached or self.fuse.lazily_detached
            except MountError as exc:
                failures.append(str(exc))
        if self.private_dir is not None and self.private_dir.exists() and not self.fuse_mounted():
            try:
                self.private_dir.rmdir()
            except OSError as exc:
                failures.append(f"removing {self.private_dir}: {exc}")
        if failures:
            raise MountError("; ".join(failures))

    def fuse_mounted(self) -> bool:
        real = os.path.realpath(self.private_dir) if self.private_dir else None
        return real is not None and any(entry.mount_point == real for entry in mounts())

    def __enter__(self) -> LoopMount:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
