"""A FUSE directory view of a squashfs image: the tree itself, parsed in Python.

For machines with no loop devices (an unprivileged container, a laptop user without root):
``fusermount3`` lets an ordinary user mount it, and :class:`~images.mount.reader.SquashReader`
does what the kernel's squashfs driver does on the kernel path. It is slower than the kernel
path (every lookup and every decompression runs in this process), which is why it is the
fallback, not the default.

Everything is read-only and immutable while mounted, so the kernel may cache names,
attributes and pages for as long as it likes. Each reader error keeps its errno: a source
that cannot deliver bytes shows up to a reading process as EIO on ``read``.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading

from images.mount.reader import SquashFile, SquashReader, SquashStat

CACHE_TIMEOUT_S = 86400.0  # nothing changes while mounted


def _attributes(entry: SquashStat) -> dict:
    mtime_ns = entry.mtime * 10**9
    return {
        "st_mode": entry.mode, "st_ino": entry.inode, "st_nlink": entry.nlink, "st_size": entry.size,
        "st_uid": entry.uid, "st_gid": entry.gid, "st_blocks": -(-entry.size // 512), "st_blksize": 128 * 1024,
        "st_atime": mtime_ns, "st_mtime": mtime_ns, "st_ctime": mtime_ns,
    }


class ImageTreeOperations:
    """mfusepy operations answering from a SquashReader (getattr, readdir, open, read, readlink)."""

    use_ns = True

    def __init__(self, reader: SquashReader) -> None:
        self.reader = reader
        self._open_files: dict[int, SquashFile] = {}
        self._handles = itertools.count(1)
        self._lock = threading.Lock()

    def init_with_config(self, conn, config) -> None:
        if config is not None:
            config.use_ino = 1  # the image's inode numbers, so hard links and `find` behave
            config.kernel_cache = 1
            config.direct_io = 0
            config.entry_timeout = config.attr_timeout = CACHE_TIMEOUT_S
            config.negative_timeout = CACHE_TIMEOUT_S
        if conn is not None:
            conn.max_read = 0

    def getattr(self, path: str, fh=None) -> dict:
        return _attributes(self.reader.stat(path))

    def readdir(self, path: str, fh) -> list:
        entries = self.reader.scandir(path)
        return [".", "..", *((name, {"st_mode": entry.mode, "st_ino": entry.inode}, 0) for name, entry in entries)]

    def readlink(self, path: str) -> str:
        return self.reader.readlink(path)

    def open(self, path: str, flags: int) -> int:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, "the image is read-only")
        file = self.reader.open(path)
        with self._lock:
            handle = next(self._handles)
            self._open_files[handle] = file
        return handle

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        file = self._open_files.get(fh)
        if file is None:
            raise OSError(errno.EBADF, "unknown file handle")
        return file.pread(offset, size)

    def release(self, path: str, fh: int) -> int:
        with self._lock:
            file = self._open_files.pop(fh, None)
        if file is not None:
            file.close()
        return 0

    def statfs(self, path: str) -> dict:
        block = self.reader.block_size
        return {"f_bsize": block, "f_frsize": block, "f_blocks": -(-self.reader.source.size // block),
                "f_bfree": 0, "f_bavail": 0, "f_files": self.reader.inode_count, "f_ffree": 0, "f_namemax": 256}


def serve_tree(reader: SquashReader, mountpoint: str, *, allow_other: bool = False) -> None:
    """Mount the tree at ``mountpoint`` and serve until unmounted (blocks)."""
    import mfusepy  # loads libfuse: only where a FUSE front end actually runs

    mfusepy.FUSE(ImageTreeOperations(reader), mountpoint, foreground=True, ro=True, allow_other=allow_other,
                 fsname="modelplane-tree", subtype="modelplane-tree", default_permissions=True)
