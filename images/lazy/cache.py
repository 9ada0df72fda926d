"""``SectorCache``: decoded sectors of one seekable image on local disk, within a size bound.

The cache is a sparse file the size of the image (``sectors.img``) holding each cached sector
at its own image offset, plus a bitmap of the sectors it holds (``present.bitmap``). Keeping
the image layout means a cached sector is one ``pread`` away and needs no index of its own.

Why each piece is there:

- ``meta.json`` names the data blob (and the sector table) the file belongs to. The directory is
  keyed by the data digest already; the check makes a reused or hand-copied directory start
  empty instead of serving another image's bytes.
- The bitmap is replaced atomically (``os.replace``) after each batch, never written in place,
  so after a crash it is some earlier bitmap in full. Data is written before the bitmap names
  it, but neither is fsynced: instead every sector the bitmap names at start-up is checked
  against its sha256 the first time it is read. A torn or lost write then costs a refetch,
  never wrong bytes.
- Eviction frees disk blocks with ``fallocate(FALLOC_FL_PUNCH_HOLE)``. Overwriting with zeros
  would *allocate* blocks, so where punching fails (a filesystem without it) the cache stops
  evicting and simply caches nothing more beyond ``max_bytes``, and logs that once.
- Holes (all-zero sectors) are never stored: ``get`` returns zeros for them, they take no room.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path

from images.seekable.index import SectorIndex

log = logging.getLogger("modelplane.images.lazy")

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
DATA_FILE = "sectors.img"
BITMAP_FILE = "present.bitmap"
META_FILE = "meta.json"
LOCK_FILE = "lock"


@functools.cache
def _fallocate():
    libc = ctypes.CDLL(None, use_errno=True)
    function = getattr(libc, "fallocate64", None) or getattr(libc, "fallocate", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        function.restype = ctypes.c_int
    return function


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the disk blocks under ``[offset, offset + length)`` of ``fd``, keeping its size.

    The range reads back as zeros. ``OSError`` (``EOPNOTSUPP`` and the like) where the platform
    or the filesystem cannot do it.
    """
    function = _fallocate()
    if function is None:
        raise OSError(errno.EOPNOTSUPP, "this C library has no fallocate()")
    if function(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"fallocate(PUNCH_HOLE) failed: {os.strerror(code)}")


def bitmap_bytes(numbers: set[int] | list[int], count: int) -> bytes:
    """Sector ``i`` is bit ``i % 8`` of byte ``i // 8``.

    >>> bitmap_bytes([0, 3, 9], 10).hex()
    '0902'
    >>> sorted(bitmap_numbers(bytes.fromhex('0902'), 10))
    [0, 3, 9]
    """
    out = bytearray(-(-count // 8))
    for number in numbers:
        out[number // 8] |= 1 << (number % 8)
    return bytes(out)


def bitmap_numbers(bitmap: bytes, count: int) -> list[int]:
    return [n for n in range(count) if bitmap[n // 8] >> (n % 8) & 1]


class SectorCache:
    """Decoded sectors of ``index``'s image under ``directory``, at most ``max_bytes`` of them.

    Thread-safe. Eviction is least-recently-used and skips sectors being read (pinned for the
    length of a ``get``) and the sectors of the batch being added. One cache object per
    directory at a time: a second one (in this or another process) gets ``EBUSY``.
    ``punch_hole`` is injectable so tests can play a filesystem without hole punching.
    """

    def __init__(self, directory: Path, index: SectorIndex, *, max_bytes: int | None = None,
                 punch_hole: Callable[[int, int, int], None] = punch_hole) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be None or >= 0, not {max_bytes}")
        self.directory = Path(directory)
        self.index = index
        self.max_bytes = max_bytes
        self._punch = punch_hole
        self._can_punch = True
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise OSError(errno.EBUSY, f"sector cache {self.directory} is in use by another reader") from None
        self._fd = -1
        try:
            present = self._open_files()
        except BaseException:
            self.close()
            raise
        self._lru: OrderedDict[int, int] = OrderedDict((n, self._size(n)) for n in present)
        self._unverified = set(present)  # written by an earlier process: checked on first read
        self._pins: Counter[int] = Counter()
        self._reserved: dict[int, int] = {}  # being written: counted in _used, not yet readable
        self._used = sum(self._lru.values())
        with self._lock:
            if self.max_bytes is not None and self._used > self.max_bytes:
                self._make_room(0, keep=set())  # the bound shrank since the last run
                self._persist()

    # -- start-up -------------------------------------------------------------------------

    def _meta(self) -> dict:
        table = hashlib.sha256("".join(s.sha256 for s in self.index.sectors).encode()).hexdigest()
        return {"data_digest": self.index.data_digest, "image_size": self.index.image_size,
                "sector_bytes": self.index.sector_bytes, "sector_table_sha256": table}

    def _open_files(self) -> list[int]:
        """The sectors an earlier run left, or none where they belong to another image."""
        meta_path, data_path, bitmap_path = (self.directory / name for name in (META_FILE, DATA_FILE, BITMAP_FILE))
        try:
            same_image = json.loads(meta_path.read_bytes()) == self._meta()
        except (OSError, ValueError):
            same_image = False
        if not same_image:
            bitmap_path.unlink(missing_ok=True)
            data_path.unlink(missing_ok=True)
            _replace(meta_path, json.dumps(self._meta()).encode())
        self._fd = os.open(data_path, os.O_RDWR | os.O_CREAT, 0o644)
        count = len(self.index.sectors)
        try:
            bitmap = bitmap_path.read_bytes()
        except FileNotFoundError:
            bitmap = b""
        if os.fstat(self._fd).st_size != self.index.image_size or len(bitmap) != -(-count // 8):
            os.ftruncate(self._fd, 0)  # frees every block an earlier run wrote
            os.ftruncate(self._fd, self.index.image_size)
            return []
        return [n for n in bitmap_numbers(bitmap, count) if self.index.sectors[n].codec != "hole"]

    # -- reads ----------------------------------------------------------------------------

    def _size(self, number: int) -> int:
        start, end = self.index.span(number)
        return end - start

    def present(self, number: int) -> bool:
        """Whether ``get(number)`` would answer without a fetch (holes always do)."""
        with self._lock:
            return self.index.sectors[number].codec == "hole" or number in self._lru

    def get(self, number: int, start: int = 0, stop: int | None = None) -> bytes | None:
        """Bytes ``[start, stop)`` of the decoded sector (all of it by default), or None when it is
        not cached or fails its check. A sector left by an earlier process is read whole once, to
        check it; after that a read of part of a sector reads only that part."""
        sector_start, sector_end = self.index.span(number)
        size = sector_end - sector_start
        stop = size if stop is None else min(stop, size)
        if self.index.sectors[number].codec == "hole":
            return bytes(max(0, stop - start))
        with self._lock:
            if number not in self._lru:
                return None
            self._lru.move_to_end(number)
            self._pins[number] += 1
            check = number in self._unverified
        try:
            if not check:
                return os.pread(self._fd, max(0, stop - start), sector_start + start)
            data = os.pread(self._fd, size, sector_start)
        finally:
            with self._lock:
                self._pins[number] -= 1
        good = len(data) == size and hashlib.sha256(data).hexdigest() == self.index.sectors[number].sha256
        with self._lock:
            if good:
                self._unverified.discard(number)
                return data[start:stop]
            if number in self._unverified and number in self._lru:
                log.warning("cached sector %d of %s does not match its digest (a torn write?): fetching it again",
                            number, self.index.data_digest)
                self._unverified.discard(number)
                self._used -= self._lru.pop(number)
                self._persist()
        return None

    # -- writes ---------------------------------------------------------------------------

    def put(self, number: int, raw: bytes) -> bool:
        """Cache one decoded, verified sector; False where the bound leaves no room for it."""
        return number in self.put_many({number: raw})

    def put_many(self, sectors: Mapping[int, bytes]) -> set[int]:
        """Cache a batch of decoded, verified sectors; returns the numbers now cached.

        Room is reserved (evicting as needed) before any byte is written, so the file's
        allocated blocks never exceed the bound by more than a partial block; the bitmap is
        replaced once, after the batch's bytes are written.
        """
        for number, raw in sectors.items():
            if len(raw) != self._size(number):
                raise ValueError(f"sector {number} has {self._size(number)} bytes, not {len(raw)}")
        accepted: list[int] = []
        with self._lock:
            self._check_open()
            for number in sectors:
                if self.index.sectors[number].codec == "hole" or number in self._lru or number in self._reserved:
                    continue
                size = self._size(number)
                if self._make_room(size, keep=set(sectors)):
                    self._reserved[number] = size
                    self._used += size
                    accepted.append(number)
        written: set[int] = set()
        try:
            for number in accepted:
                _pwrite_all(self._fd, sectors[number], self.index.span(number)[0])
                written.add(number)
        except OSError as exc:
            log.warning("cannot write sector to %s (%s): serving it without caching it", self.directory, exc)
        with self._lock:
            for number in accepted:
                size = self._reserved.pop(number)
                if number in written:
                    self._lru[number] = size
                else:
                    self._used -= size
            self._persist()
        return written | {n for n in sectors if self.index.sectors[n].codec == "hole"}

    def _make_room(self, size: int, keep: set[int]) -> bool:
        """Evict least-recently-used sectors until ``size`` more bytes fit (lock held)."""
        if self.max_bytes is None:
            return True
        if size > self.max_bytes:
            return False
        while self._used + size > self.max_bytes:
            victim = next((n for n in self._lru if not self._pins[n] and n not in keep), None)
            if victim is None or not self._can_punch:
                return False
            start, end = self.index.span(victim)
            try:
                self._punch(self._fd, start, end - start)
            except OSError as exc:
                self._can_punch = False
                log.warning("cannot free disk blocks in %s (%s): caching no sectors beyond max_bytes=%d",
                            self.directory / DATA_FILE, exc, self.max_bytes)
                return False
            self._used -= self._lru.pop(victim)
            self._unverified.discard(victim)
        return True

    def _persist(self) -> None:
        _replace(self.directory / BITMAP_FILE, bitmap_bytes(list(self._lru), len(self.index.sectors)))

    # -- accounting -----------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of the sectors cached or being written."""
        with self._lock:
            return self._used

    def free_bytes(self) -> int | None:
        """Room left before eviction starts; None without a bound."""
        with self._lock:
            return None if self.max_bytes is None else max(0, self.max_bytes - self._used)

    def present_numbers(self) -> list[int]:
        """The cached (non-hole) sectors, least recently used first."""
        with self._lock:
            return list(self._lru)

    def _check_open(self) -> None:
        if self._fd < 0:
            raise OSError(errno.EBADF, f"sector cache {self.directory} is closed")

    def close(self) -> None:
        """Close the files and release the directory; a second call does nothing."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a reader (or a restart) sees the old or the new file."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
