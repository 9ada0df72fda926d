"""``BlockSource``: a read-only byte range of known size, what every front end reads from.

The lazy fetcher (:class:`images.lazy.fetcher.LazyImage`) is one; :class:`FileSource`, a
plain local file, is another (a fully pulled image, and the tests' reference).
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Protocol


class BlockSource(Protocol):
    size: int

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer only at the end). An ``OSError`` with
        ``errno.EIO`` when the bytes cannot be had: never wrong bytes."""

    def close(self) -> None: ...


class FileSource:
    """A local file as a BlockSource (positional reads: safe from many threads)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size
        self._lock = threading.Lock()

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise OSError(errno.EINVAL, f"negative offset or length ({offset}, {length})")
        return os.pread(self._fd, max(0, min(length, self.size - offset)), offset)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
