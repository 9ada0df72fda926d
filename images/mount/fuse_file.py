"""A FUSE filesystem holding exactly one read-only file, ``image``: the bytes of a BlockSource.

This is the bottom half of the kernel path (:mod:`images.mount.kernel`): a read-only loop
device is attached to ``<mountpoint>/image`` and the kernel's own squashfs driver mounts it,
so the kernel parses the image, caches its pages and decompresses in parallel, while every
byte it asks for comes from ``source.read`` (a lazy source fetches it on first use).

The file's pages go through the page cache (``direct_io`` off, ``kernel_cache`` on: the image
never changes while mounted), requests may be as large as the kernel allows (libfuse 3 lets
the kernel send up to 1 MiB), and a source error reaches the loop device as EIO. The
operations take no lock: ``source.read`` must be safe from many threads, as
:class:`~images.source.FileSource` and the lazy fetcher are.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time

from images.source import BlockSource

IMAGE_NAME = "image"
IMAGE_MODE = stat.S_IFREG | 0o444
ROOT_MODE = stat.S_IFDIR | 0o555
CACHE_TIMEOUT_S = 86400.0  # attributes and names never change while mounted

log = logging.getLogger("modelplane.images.mount")


class ImageFileOperations:
    """mfusepy operations for a root directory holding the single file ``image``."""

    use_ns = True  # times in integer nanoseconds

    def __init__(self, source: BlockSource) -> None:
        self.source = source
        self._mounted_at_ns = time.time_ns()

    def init_with_config(self, conn, config) -> None:
        if config is not None:
            config.kernel_cache = 1
            config.direct_io = 0
            config.entry_timeout = config.attr_timeout = CACHE_TIMEOUT_S
            config.negative_timeout = CACHE_TIMEOUT_S
        if conn is not None:
            conn.max_read = 0  # no limit of our own on the size of one read request

    def getattr(self, path: str, fh=None) -> dict:
        times = {"st_atime": self._mounted_at_ns, "st_mtime": self._mounted_at_ns, "st_ctime": self._mounted_at_ns}
        owner = {"st_uid": os.getuid(), "st_gid": os.getgid()}
        if path == "/":
            return {"st_mode": ROOT_MODE, "st_nlink": 2, "st_size": 0, **times, **owner}
        if path == f"/{IMAGE_NAME}":
            return {"st_mode": IMAGE_MODE, "st_nlink": 1, "st_size": self.source.size,
                    "st_blocks": -(-self.source.size // 512), "st_blksize": 2**20, **times, **owner}
        raise OSError(errno.ENOENT, "no such entry: the only file here is " + IMAGE_NAME)

    def readdir(self, path: str, fh) -> list:
        if path != "/":
            raise OSError(errno.ENOTDIR, "not a directory")
        return [".", "..", (IMAGE_NAME, {"st_mode": IMAGE_MODE}, 0)]

    def open(self, path: str, flags: int) -> int:
        if path != f"/{IMAGE_NAME}":
            raise OSError(errno.ENOENT, "no such file")
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, "the image is read-only")
        return 0

    def read(self, path: str, size: int, offset: int, fh) -> bytes:
        if offset >= self.source.size:
            return b""
        try:
            data = self.source.read(offset, min(size, self.source.size - offset))
        except OSError as exc:
            log.warning("read of %d bytes at %d failed: %s", size, offset, exc)
            raise OSError(exc.errno if isinstance(exc.errno, int) and exc.errno > 0 else errno.EIO, str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - any failure to get the bytes is an I/O error to the kernel
            log.exception("read of %d bytes at %d failed", size, offset)
            raise OSError(errno.EIO, f"source failed: {exc!r}") from exc
        return data

    def statfs(self, path: str) -> dict:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": -(-self.source.size // 4096), "f_bfree": 0,
                "f_bavail": 0, "f_files": 2, "f_ffree": 0, "f_namemax": 255}


def serve_file(source: BlockSource, mountpoint: str, *, allow_other: bool = False) -> None:
    """Mount ``source`` as ``<mountpoint>/image`` and serve until unmounted (blocks)."""
    import mfusepy  # loads libfuse: only where a FUSE front end actually runs

    mfusepy.FUSE(ImageFileOperations(source), mountpoint, foreground=True, ro=True, allow_other=allow_other,
                 fsname="modelplane-image", subtype="modelplane-image", default_permissions=True)
