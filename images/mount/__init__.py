"""Front ends over a :class:`images.source.BlockSource` holding a squashfs image.

- :class:`~images.mount.reader.SquashReader`: open/read/list/stat in-process, no privileges;
- :func:`~images.mount.front_ends.mount_image`: the tree mounted, by the kernel (FUSE file on
  a read-only loop device, :mod:`images.mount.kernel`) or by a FUSE directory view
  (:mod:`images.mount.fuse_dir`), each served by a child process (:mod:`images.mount.daemon`,
  started and reaped by :class:`~images.mount.process.FuseProcess`);
- :func:`~images.mount.system.kernel_paths_available` / :func:`~images.mount.system.fuse_available`:
  whether this machine can, and why not.

Nothing here loads libfuse on import; only the daemon does.
"""

from images.mount.front_ends import MountConfig, mount_image
from images.mount.kernel import LoopMount, LoopMountConfig
from images.mount.process import FuseProcess, FuseProcessConfig
from images.mount.reader import NotSquashfsError, ReaderConfig, SourceFile, SquashFile, SquashReader, SquashStat
from images.mount.sources import UnreadableRanges, open_source
from images.mount.system import MountError, fuse_available, kernel_paths_available

__all__ = [
    "FuseProcess", "FuseProcessConfig", "LoopMount", "LoopMountConfig", "MountConfig", "MountError",
    "NotSquashfsError", "ReaderConfig", "SourceFile", "SquashFile", "SquashReader", "SquashStat",
    "UnreadableRanges", "fuse_available", "kernel_paths_available", "mount_image", "open_source",
]
