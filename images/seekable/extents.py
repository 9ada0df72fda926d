"""Where a file's bytes lie in a squashfs image, and which sectors a start-up touches first.

The lazy fetcher prefetches sectors in the order the runtime first needs them. That order is
worked out at build time from the files the runtime reads while it starts: each file's data
blocks and tail fragment are byte ranges of the image (:func:`file_extents`), the tables any
lookup reads are others (:func:`metadata_ranges`), and :func:`prefetch_order` maps the ranges,
in start-up order, to sector numbers.

squashfs 4 stores a regular file as consecutive data blocks from ``start_block``, each listed
by its stored size (bit 24 set: stored uncompressed; size 0: a sparse all-zero block that
takes no bytes), plus optionally a tail in a fragment block shared with other small files.
The image reads through dissect.squashfs, so ``source`` can be a local file or any
:class:`images.source.BlockSource` (a lazy image reads only the metadata it needs).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path

from dissect.squashfs import SquashFS
from dissect.squashfs.exceptions import Error as SquashfsError

from images.seekable.index import SectorIndex
from images.source import BlockSource

SUPERBLOCK_BYTES = 96
UNCOMPRESSED_BLOCK_BIT = 1 << 24  # in a data block's or fragment's stored size
UNCOMPRESSED_METADATA_BIT = 1 << 15  # in a metadata block's 2-byte header
NO_FRAGMENT = 0xFFFFFFFF
COMPRESSOR_OPTIONS_FLAG_BIT = 10  # superblock flag: compressor options follow the superblock

Extent = tuple[int, int]  # [start, end) in the image


class _SourceFile(io.RawIOBase):
    """A BlockSource as the seekable binary file dissect.squashfs reads from."""

    def __init__(self, source: BlockSource) -> None:
        self._source = source
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._source.size}[whence]
        self._position = base + offset
        return self._position

    def readinto(self, buffer) -> int:
        data = self._source.read(self._position, len(buffer))
        buffer[:len(data)] = data
        self._position += len(data)
        return len(data)


@contextmanager
def _opened(source: BlockSource | Path | str):
    """The squashfs of ``source``; a path is opened and closed here, a BlockSource is the caller's."""
    if isinstance(source, (str, Path)):
        with open(source, "rb") as file:
            yield _squashfs(file, source)
    else:
        yield _squashfs(io.BufferedReader(_SourceFile(source), buffer_size=8192), source)


def _squashfs(file, name) -> SquashFS:
    try:
        return SquashFS(file)
    except (ValueError, NotImplementedError, EOFError) as exc:
        raise ValueError(f"{name} is not a squashfs 4 image: {exc}") from None


def merge_extents(extents: Iterable[Extent]) -> list[Extent]:
    """``extents`` in order, each joined to the one before where they touch or overlap.

    >>> merge_extents([(96, 200), (200, 300), (400, 500), (450, 460)])
    [(96, 300), (400, 500)]
    """
    merged: list[Extent] = []
    for start, end in extents:
        if end <= start:
            continue
        if merged and merged[-1][0] <= start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def block_extents(start_block: int, stored_sizes: Sequence[int],
                  fragment: tuple[int, int, int, int] | None = None) -> list[Extent]:
    """The extents of a file from its inode's fields, no I/O.

    ``stored_sizes`` is the inode's block list; ``fragment`` is (fragment block start, its
    stored size word, the file's offset in the block, tail bytes) or None. A compressed
    fragment block is read whole to get any of it, so its extent is the whole block; an
    uncompressed one is just the file's slice.

    Two 128 KiB blocks stored raw, a sparse one, then one compressed to 20000 bytes lie back
    to back from byte 96; the sparse one takes no bytes:

    >>> block_extents(96, [131072 | 1 << 24, 131072 | 1 << 24, 0, 20000])
    [(96, 282240)]
    >>> block_extents(96, [], fragment=(5000, 300 | 1 << 24, 40, 100))  # raw fragment: the slice
    [(5040, 5140)]
    >>> block_extents(96, [], fragment=(5000, 300, 40, 100))  # compressed: the whole block
    [(5000, 5300)]
    """
    extents = []
    position = start_block
    for word in stored_sizes:
        size = word & ~UNCOMPRESSED_BLOCK_BIT
        extents.append((position, position + size))  # size 0 (sparse) is dropped by the merge
        position += size
    if fragment is not None:
        block_start, size_word, offset, tail_bytes = fragment
        if size_word & UNCOMPRESSED_BLOCK_BIT:
            extents.append((block_start + offset, block_start + offset + tail_bytes))
        else:
            extents.append((block_start, block_start + (size_word & ~UNCOMPRESSED_BLOCK_BIT)))
    return merge_extents(extents)


class _Listings:
    """Path lookups in ``fs`` that list each directory once.

    dissect.squashfs's ``get`` reads every directory on the path again for each lookup, parsing
    each entry up to the one it wants: the 7,233 files a vLLM replica opens while it starts,
    looked up in its environment's image that way, took 75 CPU-seconds (2.5 million entries
    parsed); with each directory's listing kept, under 2. Same answers as ``get``: symbolic
    links are followed on the way (not the last component), ``..`` goes to the parent,
    FileNotFoundError or NotADirectoryError for a path that is not there.
    """

    def __init__(self, fs: SquashFS) -> None:
        self._fs = fs
        self._entries: dict[tuple[int, int], dict] = {}

    def get(self, path: str, node=None):
        node = node or self._fs.root
        for part in path.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                node = node.parent or node
                continue
            while node.is_symlink():
                node = self.get(node.link, None if node.link.startswith("/") else node.parent)
            if not node.is_dir():
                raise NotADirectoryError(f"{path}: {node.name} is not a directory")
            key = (node.block, node.offset)
            if key not in self._entries:
                self._entries[key] = node.listdir()
            try:
                node = self._entries[key][part]
            except KeyError:
                raise FileNotFoundError(f"File not found: {path}") from None
        return node


def file_extents(source: BlockSource | Path | str, paths: Sequence[str]) -> dict[str, list[Extent]]:
    """For each path in ``paths`` that is in the image, the [start, end) ranges its data takes.

    Paths are relative to the image's root (a leading ``/`` is fine). A directory, symlink or
    device has no data extents (``[]``: what it holds lives in the metadata tables, see
    :func:`metadata_ranges`). A path not in the image is left out of the answer: a start-up
    trace covers every layer of an image, and this image is one layer.
    """
    found: dict[str, list[Extent]] = {}
    with _opened(source) as fs:
        tree = _Listings(fs)
        for path in paths:
            try:
                inode = tree.get(path)
                if not inode.is_file():
                    found[path] = []
                    continue
                header = inode.header
                stored_sizes = [word for word, _ in inode.block_list if word is not None]
                fragment = None
                if header.fragment != NO_FRAGMENT:
                    entry = fs._lookup_fragment(header.fragment)
                    tail_bytes = header.file_size % fs.block_size
                    fragment = (entry.start_block, entry.size, header.offset, tail_bytes)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except SquashfsError as exc:
                raise ValueError(f"cannot read {path!r} from the squashfs image: {exc}") from None
            found[path] = block_extents(header.start_block, stored_sizes, fragment)
    return found


def metadata_ranges(source: BlockSource | Path | str) -> list[Extent]:
    """The superblock (with the compressor options after it, if any) and the tables.

    squashfs writes the inode, directory, fragment, export, id and xattr tables after all
    file data, from ``inode_table_start`` to ``bytes_used``; every path lookup reads them.
    """
    with _opened(source) as fs:
        superblock_end = SUPERBLOCK_BYTES
        if (fs.sb.flags >> COMPRESSOR_OPTIONS_FLAG_BIT) & 1:
            fs.fh.seek(SUPERBLOCK_BYTES)
            header = int.from_bytes(fs.fh.read(2), "little")
            superblock_end += 2 + (header & ~UNCOMPRESSED_METADATA_BIT)
        return merge_extents([(0, superblock_end), (fs.sb.inode_table_start, fs.sb.bytes_used)])


def prefetch_order(index: SectorIndex, ranges_in_startup_order: Iterable[Extent]) -> tuple[int, ...]:
    """The sectors the ranges touch, in the order they are first touched, each once.

    >>> from images.seekable.index import Sector
    >>> index = SectorIndex(5 * 4096, 4096, (Sector(0, 1, "raw", "0" * 64),) * 5)
    >>> prefetch_order(index, [(0, 96), (16000, 20480), (4000, 4200), (8192, 8192)])
    (0, 3, 4, 1)
    """
    seen: dict[int, None] = {}
    for start, end in ranges_in_startup_order:
        for number in index.covering(start, end - start):
            seen.setdefault(number)
    return tuple(seen)
