"""``mount_image``: pick a front end for an image source, mount it, always tear it down.

- ``"kernel"``: FUSE file, read-only loop device, the kernel's squashfs
  (:class:`images.mount.kernel.LoopMount`): fastest, needs root and loop devices;
- ``"fuse-dir"``: the tree served by a FUSE daemon parsing squashfs in Python
  (:mod:`images.mount.fuse_dir`): works where ``fusermount3`` lets a user mount;
- ``"auto"``: the kernel path where :func:`images.mount.system.kernel_paths_available`
  says it can run, else the directory view.

A process that needs no mount at all reads through :class:`images.mount.reader.SquashReader`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from images.mount.kernel import LoopMount, LoopMountConfig
from images.mount.process import FuseProcess, FuseProcessConfig
from images.mount.system import kernel_paths_available

MODES = ("kernel", "fuse-dir", "auto")


@dataclass(frozen=True)
class MountConfig:
    kernel: LoopMountConfig = field(default_factory=LoopMountConfig)
    fuse_dir: FuseProcessConfig = field(default_factory=FuseProcessConfig)


def choose_mode(mode: str, kernel_available: tuple[bool, str]) -> str:
    """The front end ``mode`` names, with ``"auto"`` decided by the kernel check.

    >>> choose_mode("auto", (False, "not root"))
    'fuse-dir'
    >>> choose_mode("auto", (True, "kernel path available"))
    'kernel'
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if mode != "auto":
        return mode
    return "kernel" if kernel_available[0] else "fuse-dir"


@contextmanager
def mount_image(source_spec: dict, target: str | Path, mode: str = "kernel", *,
                config: MountConfig = MountConfig(), stats_file: Path | None = None) -> Iterator[Path]:
    """The image's tree visible at ``target`` (an existing empty directory) inside the block.

    ``source_spec`` is what :func:`images.mount.sources.open_source` takes. On leaving the
    block, however it is left, the mount, the loop device and the daemon are gone.
    """
    chosen = choose_mode(mode, kernel_paths_available() if mode == "auto" else (False, ""))
    target = Path(target)
    if chosen == "kernel":
        with LoopMount.open(source_spec, target, config=config.kernel, stats_file=stats_file):
            yield target
    else:
        with FuseProcess.start("dir", source_spec, target, config=config.fuse_dir, stats_file=stats_file):
            yield target
