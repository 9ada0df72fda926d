"""What the machine says about mounts and loop devices, and whether a front end can run here.

The parsers and verdicts are pure functions of text or of gathered facts, so they are tested
with examples; the few functions that read ``/proc`` or run a command only gather.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CAP_SYS_ADMIN = 21  # bit in /proc/self/status CapEff: mount(2) and loop ioctls need it


class MountError(RuntimeError):
    """A mount or unmount step failed; the message names the step and what the tool said."""


@dataclass(frozen=True)
class MountEntry:
    mount_point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    r"""Undo the kernel's octal escapes (``\040`` is a space) in a mountinfo field."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountEntry]:
    r"""The mounts listed in ``/proc/self/mountinfo`` text, in order.

    >>> line = "36 35 0:41 / /tmp/a\\040b rw,nosuid - fuse.modelplane-image modelplane-image rw,user_id=0"
    >>> parse_mountinfo(line)
    [MountEntry(mount_point='/tmp/a b', fstype='fuse.modelplane-image', source='modelplane-image')]
    """
    entries = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        separator = fields.index("-")
        if separator < 5 or len(fields) < separator + 3:
            continue
        entries.append(MountEntry(_unescape(fields[4]), fields[separator + 1], _unescape(fields[separator + 2])))
    return entries


def mounts() -> list[MountEntry]:
    return parse_mountinfo(Path("/proc/self/mountinfo").read_text())


def mounted_at(path: str | Path, fstype_prefix: str = "") -> bool:
    """Whether something (of a type starting with ``fstype_prefix``) is mounted at ``path``."""
    real = os.path.realpath(path)
    return any(entry.mount_point == real and entry.fstype.startswith(fstype_prefix) for entry in mounts())


def parse_loop_list(losetup_json: str) -> dict[str, str]:
    """``{device: backing file}`` from ``losetup --list --json`` output.

    >>> parse_loop_list('{"loopdevices": [{"name": "/dev/loop3", "back-file": "/run/x/image (deleted)"}]}')
    {'/dev/loop3': '/run/x/image (deleted)'}
    >>> parse_loop_list("")
    {}
    """
    if not losetup_json.strip():
        return {}
    return {device["name"]: device.get("back-file") or "" for device in json.loads(losetup_json)["loopdevices"]}


def attached_loop_devices() -> dict[str, str]:
    """Every attached loop device and its backing file (empty where losetup is missing)."""
    if shutil.which("losetup") is None:
        return {}
    listed = subprocess.run(["losetup", "--list", "--json", "--output", "NAME,BACK-FILE"],
                            capture_output=True, text=True, check=False)
    return parse_loop_list(listed.stdout) if listed.returncode == 0 else {}


def loop_backing_file(device: str) -> str | None:
    """The backing file of ``/dev/loopN`` from sysfs, or None where it is detached."""
    try:
        return Path(f"/sys/block/{Path(device).name}/loop/backing_file").read_text().strip()
    except OSError:
        return None


def run_tool(argv: list[str], step: str, timeout_s: float = 60.0) -> str:
    """Run a mount tool; its stdout, or a MountError that quotes its stderr."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MountError(f"{step}: {' '.join(argv)} failed: {exc}") from exc
    if done.returncode != 0:
        raise MountError(f"{step}: {' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def unmount(path: str | Path, *, fuse: bool, busy_grace_s: float, poll_interval_s: float = 0.05) -> bool:
    """Unmount ``path``; retry while busy for ``busy_grace_s``, then detach it lazily.

    Returns True when a lazy detach was needed (users still hold files: the filesystem
    lives on, out of sight, until they let go). Nothing mounted there is not an error, so
    running this twice changes nothing.
    """
    plain = ["fusermount3", "-u", str(path)] if fuse and shutil.which("fusermount3") else ["umount", str(path)]
    deadline = time.monotonic() + busy_grace_s
    while mounted_at(path):
        if subprocess.run(plain, capture_output=True, check=False).returncode == 0:
            return False
        if time.monotonic() >= deadline:
            lazy = plain[:-1] + ["-z", str(path)] if plain[0] == "fusermount3" else ["umount", "-l", str(path)]
            if mounted_at(path):
                run_tool(lazy, f"detaching the busy mount at {path}")
            return True
        time.sleep(poll_interval_s)
    return False


@dataclass(frozen=True)
class MountFacts:
    """What decides whether a front end can run; gathered by :func:`gather_facts`."""

    is_root: bool
    has_cap_sys_admin: bool
    dev_fuse: bool
    fusermount3: bool
    libfuse3: bool
    loop_devices: bool  # /dev/loop-control, or a /dev/loopN to use
    tools: bool  # losetup, mount, umount
    squashfs: bool  # in /proc/filesystems, or a module the kernel can load


def kernel_verdict(facts: MountFacts) -> tuple[bool, str]:
    """Whether the kernel path (FUSE file, loop device, kernel squashfs) can run; why not.

    >>> kernel_verdict(MountFacts(True, True, True, True, True, True, True, True))
    (True, 'kernel path available')
    >>> kernel_verdict(MountFacts(False, False, True, True, True, True, True, True))
    (False, 'not root: attaching a loop device and mounting squashfs need root')
    """
    missing = [
        (facts.is_root, "not root: attaching a loop device and mounting squashfs need root"),
        (facts.has_cap_sys_admin, "no CAP_SYS_ADMIN (an unprivileged container?): mount(2) is refused"),
        (facts.dev_fuse, "no /dev/fuse"),
        (facts.fusermount3, "no fusermount3 (package fuse3)"),
        (facts.libfuse3, "libfuse3 cannot be loaded (package libfuse3-3)"),
        (facts.loop_devices, "no loop devices (/dev/loop-control or /dev/loopN)"),
        (facts.tools, "losetup, mount or umount missing (package util-linux, mount)"),
        (facts.squashfs, "the kernel has no squashfs support (/proc/filesystems, modules)"),
    ]
    for present, reason in missing:
        if not present:
            return False, reason
    return True, "kernel path available"


def fuse_verdict(facts: MountFacts) -> tuple[bool, str]:
    """Whether a FUSE front end (the directory view) can mount here; why not.

    >>> fuse_verdict(MountFacts(False, False, True, True, True, False, False, False))
    (True, 'FUSE available')
    >>> fuse_verdict(MountFacts(False, False, True, False, True, False, False, False))
    (False, 'not root and no fusermount3 to mount as a user')
    """
    if not facts.dev_fuse:
        return False, "no /dev/fuse"
    if not facts.libfuse3:
        return False, "libfuse3 cannot be loaded (package libfuse3-3)"
    if not facts.fusermount3 and not (facts.is_root and facts.has_cap_sys_admin):
        return False, "not root and no fusermount3 to mount as a user"
    return True, "FUSE available"


def _libfuse3_loads() -> bool:
    for name in filter(None, [ctypes.util.find_library("fuse3"), "libfuse3.so.3"]):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def _cap_sys_admin() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    return False


def _squashfs_in_kernel() -> bool:
    if "squashfs" in Path("/proc/filesystems").read_text().split():
        return True
    modules = Path("/lib/modules") / os.uname().release
    return any(modules.glob("kernel/fs/squashfs/squashfs.ko*"))


def gather_facts() -> MountFacts:
    dev_fuse = os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK)
    loops = os.path.exists("/dev/loop-control") or any(Path("/dev").glob("loop[0-9]*"))
    return MountFacts(
        is_root=os.geteuid() == 0, has_cap_sys_admin=_cap_sys_admin(), dev_fuse=dev_fuse,
        fusermount3=shutil.which("fusermount3") is not None, libfuse3=_libfuse3_loads(), loop_devices=loops,
        tools=all(shutil.which(tool) for tool in ("losetup", "mount", "umount")), squashfs=_squashfs_in_kernel(),
    )


def kernel_paths_available() -> tuple[bool, str]:
    """Whether this machine can mount an image the kernel way, and if not, why not."""
    return kernel_verdict(gather_facts())


def fuse_available() -> tuple[bool, str]:
    """Whether this machine can mount the FUSE directory view, and if not, why not."""
    return fuse_verdict(gather_facts())
