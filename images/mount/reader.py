"""Read a squashfs image held in any :class:`~images.source.BlockSource`, with no privileges.

:class:`SquashReader` answers ``open``/``read_bytes``/``listdir``/``stat``/``readlink``/``walk``
from the image's own tables through dissect.squashfs; nothing is mounted. The FUSE directory
view (:mod:`images.mount.fuse_dir`) is built on it, and so is anything that only wants a few
files of an image (a config file, a tokenizer) without pulling or mounting all of it.

Errors keep the contract of the source: bytes that cannot be had surface as
``OSError(errno.EIO)`` (never as wrong bytes, never as a parser's ``EOFError`` or
``ValueError``), a missing path as ``FileNotFoundError`` (``ENOENT``), a directory opened as a
file as ``IsADirectoryError`` (``EISDIR``): every ``OSError`` carries an errno, which is what
a FUSE front end hands back to the kernel.
"""

from __future__ import annotations

import errno
import io
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

from dissect.squashfs import SquashFS

from images.source import BlockSource


SQUASHFS_MAGIC = b"hsqs"  # the first 4 bytes of a (little-endian) squashfs image


class NotSquashfsError(ValueError):
    """The source does not start with a squashfs superblock."""


@dataclass(frozen=True)
class ReaderConfig:
    """Cache sizes for one reader.

    dissect.squashfs decompresses a whole data block (128 KiB by default) to serve any byte
    of it; the data cache keeps the last ``data_cache_bytes`` of decompressed blocks so
    reads that are not block aligned (the kernel's 128 KiB FUSE reads at odd offsets) do not
    decompress each block twice. Metadata blocks (at most 8 KiB each) have a cache of their
    own so a long streaming read never evicts the tables every path lookup needs.
    """

    data_cache_bytes: int = 32 * 2**20
    metadata_cache_blocks: int = 4096
    max_symlink_hops: int = 40  # the kernel's limit too (ELOOP past it)

    def __post_init__(self) -> None:
        if self.data_cache_bytes < 0 or self.metadata_cache_blocks < 1 or self.max_symlink_hops < 1:
            raise ValueError(f"invalid reader config: {self}")


@dataclass(frozen=True)
class SquashStat:
    """What ``stat`` says of one entry. ``mode`` is the full ``st_mode`` (type and permission
    bits), ``size`` is in bytes (a symlink's: its target's length), ``mtime`` is in whole
    seconds since the epoch, ``inode`` is the image's inode number."""

    mode: int
    size: int
    mtime: int
    is_dir: bool
    is_file: bool
    is_symlink: bool
    inode: int
    nlink: int = 1
    uid: int = 0
    gid: int = 0


class SourceFile(io.RawIOBase):
    """A BlockSource as the seekable binary file dissect.squashfs reads from.

    dissect.squashfs reads by ``seek()`` and then ``read()`` on one shared handle. The FUSE
    directory view serves several kernel requests at once, each on its own thread, so the
    position here is kept per thread: one thread's seek never moves the read of another.

    A read returns every byte asked for up to the end of the source, or raises: a source
    that answers short inside its size is turned into ``OSError(EIO)`` rather than passed on,
    because a parser handed short bytes fails later with an error that no longer says why.
    """

    def __init__(self, source: BlockSource) -> None:
        super().__init__()
        self.source = source
        self._positions = threading.local()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return getattr(self._positions, "offset", 0)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.tell(), io.SEEK_END: self.source.size}.get(whence)
        if base is None:
            raise OSError(errno.EINVAL, f"invalid whence {whence}")
        if base + offset < 0:
            raise OSError(errno.EINVAL, f"negative seek position {base + offset}")
        self._positions.offset = base + offset
        return self._positions.offset

    def pread(self, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer only at the end of the source); no position."""
        length = max(0, min(length, self.source.size - offset))
        if length == 0:
            return b""
        data = self.source.read(offset, length)
        if len(data) != length:
            raise OSError(errno.EIO, f"source gave {len(data)} of {length} bytes at offset {offset}")
        return data

    def read(self, size: int | None = -1) -> bytes:
        offset = self.tell()
        data = self.pread(offset, self.source.size - offset if size is None or size < 0 else size)
        self._positions.offset = offset + len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


@contextmanager
def image_errors(what: str) -> Iterator[None]:
    """Let an ``OSError`` with an errno through; turn anything else into ``OSError(EIO)``.

    The parser raises ``EOFError``, ``ValueError``, ``struct.error`` or a decompressor's
    error when the bytes it got are not a valid image. To a reader that is what the kernel
    reports for a corrupt block device: EIO.
    """
    try:
        yield
    except OSError as exc:
        if isinstance(exc.errno, int) and exc.errno > 0:
            raise
        raise OSError(errno.EIO, f"{what}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - every parser failure is an unreadable image
        raise OSError(errno.EIO, f"{what}: the image is unreadable or corrupt ({exc!r})") from exc


def _parts(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


class SquashFile(io.RawIOBase):
    """A regular file of the image, read-only. ``pread`` keeps no position, so the FUSE view
    serves concurrent reads of one open file without a lock; ``read``/``seek`` hold one."""

    def __init__(self, stream, size: int, block_size: int, name: str) -> None:
        super().__init__()
        self._stream = stream  # dissect's FileStream; only its block-aligned _read is used
        self.size = size
        self.name = name
        self._block_size = block_size
        self._offset = 0
        self._lock = threading.Lock()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def pread(self, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset``, fewer only at the end of the file."""
        self._checkClosed()
        if offset < 0 or length < 0:
            raise OSError(errno.EINVAL, f"negative offset or length ({offset}, {length})")
        end = min(offset + length, self.size)
        if offset >= end:
            return b""
        # dissect's stream decodes whole blocks: ask it for the aligned span that covers the range
        start = offset - offset % self._block_size
        span = -(-(end - start) // self._block_size) * self._block_size
        with image_errors(f"reading {self.name!r}"):
            data = self._stream._read(start, span)
        piece = data[offset - start : end - start]
        if len(piece) != end - offset:
            raise OSError(errno.EIO, f"{self.name!r}: {len(piece)} of {end - offset} bytes at offset {offset}")
        return piece

    def read(self, size: int | None = -1) -> bytes:
        with self._lock:
            length = self.size - self._offset if size is None or size < 0 else size
            data = self.pread(self._offset, length)
            self._offset += len(data)
            return data

    def readall(self) -> bytes:
        return self.read()

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def tell(self) -> int:
        return self._offset

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        with self._lock:
            base = {io.SEEK_SET: 0, io.SEEK_CUR: self._offset, io.SEEK_END: self.size}.get(whence)
            if base is None or base + offset < 0:
                raise OSError(errno.EINVAL, f"invalid seek ({offset}, whence={whence})")
            self._offset = base + offset
            return self._offset


class SquashReader:
    """The files of a squashfs image in ``source``, read in-process.

    Paths are relative to the image's root, with or without a leading ``/``. Symlinks are
    followed inside the image (an absolute target starts from the image's root, never the
    host's). ``stat`` does not follow a final symlink, so it can say ``is_symlink``; pass
    ``follow_symlinks=True`` for what the target is. The reader does not own ``source``.
    """

    def __init__(self, source: BlockSource, config: ReaderConfig = ReaderConfig()) -> None:
        self.source = source
        self.config = config
        self._file = SourceFile(source)
        if self._file.pread(0, 4) != SQUASHFS_MAGIC:
            raise NotSquashfsError(f"{source!r} does not start with a squashfs superblock")
        with image_errors("reading the squashfs superblock and tables"):
            self._fs = SquashFS(self._file)
        self._install_caches()

    def _install_caches(self) -> None:
        """Split dissect's one block cache into a metadata and a data cache (see ReaderConfig)."""
        fs = self._fs
        raw_read_block = SquashFS._read_block.__get__(fs)
        metadata = lru_cache(self.config.metadata_cache_blocks)(lambda block: raw_read_block(block))
        data_blocks = max(1, self.config.data_cache_bytes // fs.block_size)
        data = lru_cache(data_blocks)(lambda block, length: raw_read_block(block, length))
        fs._read_block = lambda block, length=None: metadata(block) if length is None else data(block, length)

    @property
    def block_size(self) -> int:
        """The image's data block size in bytes (128 KiB unless mksquashfs was told otherwise)."""
        return self._fs.block_size

    @property
    def inode_count(self) -> int:
        return self._fs.sb.inodes

    def _children(self, directory) -> dict:
        with image_errors(f"listing directory inode {directory.inode_number}"):
            return directory.listdir()  # cached on the inode object: lookups reuse the same ones

    def _resolve(self, path: str, follow_final: bool):
        root = self._fs.root
        chain = [root]  # the directories walked so far, for ".."
        pending = deque(_parts(path))
        follow_final = follow_final or path.endswith("/")
        hops = 0
        with image_errors(f"looking up {path!r}"):
            while pending:
                name = pending.popleft()
                if name == "..":
                    if len(chain) > 1:
                        chain.pop()
                    continue
                if not chain[-1].is_dir():
                    raise NotADirectoryError(errno.ENOTDIR, "Not a directory in the image", path)
                entry = self._children(chain[-1]).get(name)
                if entry is None:
                    raise FileNotFoundError(errno.ENOENT, "No such file or directory in the image", path)
                if entry.is_symlink() and (pending or follow_final):
                    hops += 1
                    if hops > self.config.max_symlink_hops:
                        raise OSError(errno.ELOOP, "Too many levels of symbolic links in the image", path)
                    target = entry.link
                    if target.startswith("/"):
                        chain = [root]
                    pending.extendleft(reversed(_parts(target)))
                    continue
                chain.append(entry)
            if path.endswith("/") and not chain[-1].is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory in the image", path)
        return chain[-1]

    def stat(self, path: str, *, follow_symlinks: bool = False) -> SquashStat:
        inode = self._resolve(path, follow_symlinks)
        with image_errors(f"reading the inode of {path!r}"):
            header = inode.header
            return SquashStat(
                mode=inode.mode, size=inode.size or 0, mtime=int(header.mtime),
                is_dir=inode.is_dir(), is_file=inode.is_file(), is_symlink=inode.is_symlink(),
                inode=inode.inode_number, nlink=int(getattr(header, "nlink", 1)),
                uid=self._fs._lookup_id(header.uid), gid=self._fs._lookup_id(header.guid),
            )

    def exists(self, path: str) -> bool:
        """Whether ``path`` names an entry (a dangling symlink exists); EIO still raises."""
        try:
            self._resolve(path, follow_final=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def listdir(self, path: str = "/") -> list[str]:
        """The names in a directory, sorted (no ``.`` or ``..``)."""
        inode = self._resolve(path, follow_final=True)
        if not inode.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory in the image", path)
        return sorted(self._children(inode))

    def scandir(self, path: str = "/") -> list[tuple[str, SquashStat]]:
        """``listdir`` with each entry's (not followed) stat, in one pass: what readdir needs."""
        base = "/".join(_parts(path))
        return [(name, self.stat(f"{base}/{name}")) for name in self.listdir(path)]

    def readlink(self, path: str) -> str:
        inode = self._resolve(path, follow_final=False)
        if not inode.is_symlink():
            raise OSError(errno.EINVAL, "Not a symbolic link in the image", path)
        with image_errors(f"reading the link {path!r}"):
            return inode.link

    def open(self, path: str) -> SquashFile:
        """A read-only binary file; use it as a context manager or close it."""
        inode = self._resolve(path, follow_final=True)
        if inode.is_dir():
            raise IsADirectoryError(errno.EISDIR, "Is a directory in the image", path)
        if not inode.is_file():
            raise OSError(errno.ENXIO, "Not a regular file in the image", path)
        with image_errors(f"opening {path!r}"):
            return SquashFile(inode.open(), inode.size, self._fs.block_size, path)

    def read_bytes(self, path: str) -> bytes:
        with self.open(path) as file:
            return file.read()

    def walk(self, top: str = "/") -> Iterator[tuple[str, list[str], list[str]]]:
        """Like ``os.walk`` (top-down, symlinks not followed, listed with the files):
        ``(directory, subdirectory names, other names)`` with directories as ``/``-rooted paths."""
        queue = deque(["/" + "/".join(_parts(top))])
        while queue:
            directory = queue.popleft()
            dirs, others = [], []
            for name, entry in self.scandir(directory):
                (dirs if entry.is_dir else others).append(name)
            yield directory, dirs, others
            queue.extendleft(reversed([f"{directory.rstrip('/')}/{name}" for name in dirs]))
