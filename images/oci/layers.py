"""Deterministic, streamed OCI layers: a directory tree in, a ``tar+gzip`` blob out.

The same tree must give the same bytes on every machine and every run, so that a rebuilt
image has the same digests and a registry that already holds a layer is not sent it again.
Everything that varies between two checkouts of the same files is therefore fixed: entries
are written in sorted order, every mtime is 0, owners are root with empty names, the gzip
header carries mtime 0 and no file name. Only the permission bits, the file contents and the
symlink targets are kept.

A model directory can be tens of GB, so nothing is held in memory: the tar stream goes
through gzip into the output file, and both digests (``diff_id`` of the tar, ``digest`` of
the gzip blob) are computed on the bytes as they pass, in one pass over the tree.

The gzip stream is written by ISA-L's igzip (the ``isal`` package, which carries its own
ISA-L build): an ordinary gzip member that every puller reads. At level 1 it compressed 1.4 GB
of vLLM's and torch's files in 3.8 CPU-seconds where zlib's level 1 took 17.6, to a blob 2.6 %
larger; the vLLM environment's layer (3.3 GB of tar) now takes 18 CPU-seconds instead of 70
(a 2-core Xeon). Its level-1 bytes are the same whichever of ISA-L's kernels runs: the same
blob from SSE4.2, AVX2 and AVX-512 (run natively and under ``qemu-x86_64 -cpu Nehalem`` and
``-cpu Haswell``), another only on a CPU without SSE4.2 (``-cpu qemu64``); aarch64's kernels
are untried (docs/images.md). zlib's bytes depended on the system's zlib build (zlib-ng-compat
writes others).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from isal import igzip

from images.oci.registry import LAYER_GZIP

COPY_CHUNK_BYTES = 1 << 20
PREFIX_DIR_MODE = 0o755  # the directories a ``prefix`` adds above the tree


@dataclass(frozen=True)
class LayerInfo:
    """What an image manifest and config need to know about a built layer."""

    digest: str  # sha256 of the gzip blob: the manifest's layer descriptor
    diff_id: str  # sha256 of the uncompressed tar: the config's rootfs.diff_ids
    size: int  # bytes of the gzip blob
    uncompressed_size: int  # bytes of the tar
    media_type: str = LAYER_GZIP


class _HashingWriter:
    """A write-only file that hashes and counts what passes through it to ``sink``."""

    def __init__(self, sink: BinaryIO) -> None:
        self._sink = sink
        self._sha256 = hashlib.sha256()
        self.bytes_written = 0

    def write(self, data: bytes) -> int:
        self._sha256.update(data)
        self.bytes_written += len(data)
        self._sink.write(data)
        return len(data)

    def flush(self) -> None:
        self._sink.flush()

    @property
    def digest(self) -> str:
        return "sha256:" + self._sha256.hexdigest()


def _sorted_walk(root: Path, exclude: Callable[[str], bool] | None) -> Iterator[tuple[str, Path, os.stat_result]]:
    """Entries in full-path order: each directory immediately followed by its subtree."""

    def walk(directory: Path, relative_dir: str) -> Iterator[tuple[str, Path, os.stat_result]]:
        with os.scandir(directory) as scan:
            names = sorted(entry.name for entry in scan)
        for name in names:
            relative = f"{relative_dir}{name}"
            if exclude is not None and exclude(relative):
                continue
            path = directory / name
            info = os.lstat(path)
            yield relative, path, info
            if stat.S_ISDIR(info.st_mode):
                yield from walk(path, relative + "/")

    yield from walk(root, "")


def _tarinfo(name: str, path: Path, info: os.stat_result, keep_times: bool = False) -> tarfile.TarInfo:
    """A normalised entry: owner root, no names, mtime 0 (or the file's, whole seconds, with
    ``keep_times``), permission bits as on disk."""
    entry = tarfile.TarInfo(name)
    entry.mtime = int(info.st_mtime) if keep_times else 0
    entry.uid = entry.gid = 0
    entry.uname = entry.gname = ""
    entry.mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISDIR(info.st_mode):
        entry.type = tarfile.DIRTYPE
    elif stat.S_ISREG(info.st_mode):
        # A hard link is written as a regular file: tar's LNK entries depend on which of the
        # names the walk meets first and make extraction order matter.
        entry.type = tarfile.REGTYPE
        entry.size = info.st_size
    elif stat.S_ISLNK(info.st_mode):
        entry.type = tarfile.SYMTYPE
        entry.linkname = os.readlink(path)
    else:
        raise ValueError(f"{path} is a socket, device or fifo; a layer holds only directories, files and symlinks")
    return entry


def _prefix_parts(prefix: str) -> list[str]:
    """The directories a prefix adds, outermost first.

    >>> _prefix_parts("/opt/modelplane/model/")
    ['opt', 'opt/modelplane', 'opt/modelplane/model']
    """
    parts = [part for part in prefix.strip("/").split("/") if part]
    if any(part in (".", "..") for part in parts):
        raise ValueError(f"layer prefix {prefix!r} must not contain '.' or '..'")
    return ["/".join(parts[:i + 1]) for i in range(len(parts))]


def build_layer(root: Path, out: Path, *, prefix: str = "", compresslevel: int = 1,
                exclude: Callable[[str], bool] | None = None, keep_times: bool = False) -> LayerInfo:
    """Write the tree under ``root`` as a gzip-compressed tar layer to ``out``.

    ``prefix`` (e.g. ``"opt/modelplane/model"``) places the tree at that path inside the
    layer, its parent directories written as entries (mode 755; the last one gets ``root``'s
    mode). ``exclude`` gets each path relative to ``root`` (posix, no prefix) and returns True
    to leave it (and, for a directory, its subtree) out. ``keep_times`` keeps the files'
    modification times (a Python environment's ``.pyc`` files are checked against them; with
    mtime 0 every import would compile again). ``compresslevel`` is ISA-L's, 0 to 3; 1, the
    default, compresses about as zlib's level 1 does (model weights hardly compress).

    Raises ValueError naming a socket, device or fifo found in the tree; ``out`` is then left
    as it was.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory")
    base_parts = _prefix_parts(prefix)
    base = base_parts[-1] + "/" if base_parts else ""
    out = Path(out)
    # Written beside ``out`` and renamed over it: ``out`` may be hard-linked into an image
    # layout (write_layout links, it does not copy), and rewriting that inode in place would
    # corrupt the layout's blob.
    temporary = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        with open(temporary, "wb") as raw:
            compressed = _HashingWriter(raw)
            # filename="" and mtime=0: the gzip header is the same bytes on every build.
            with igzip.IGzipFile(filename="", mode="wb", compresslevel=compresslevel, fileobj=compressed,
                                 mtime=0) as gz:
                uncompressed = _HashingWriter(gz)
                with tarfile.open(fileobj=uncompressed, mode="w|", format=tarfile.PAX_FORMAT,
                                  bufsize=COPY_CHUNK_BYTES) as tar:
                    tar.copybufsize = COPY_CHUNK_BYTES
                    root_info = os.stat(root)
                    for i, part in enumerate(base_parts):
                        entry = _tarinfo(part, root, root_info)
                        if i < len(base_parts) - 1:
                            entry.mode = PREFIX_DIR_MODE
                        tar.addfile(entry)
                    for relative, path, info in _sorted_walk(root, exclude):
                        entry = _tarinfo(base + relative, path, info, keep_times)
                        if entry.type == tarfile.REGTYPE:
                            with open(path, "rb") as source:
                                tar.addfile(entry, source)
                        else:
                            tar.addfile(entry)
        os.replace(temporary, out)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return LayerInfo(digest=compressed.digest, diff_id=uncompressed.digest,
                     size=compressed.bytes_written, uncompressed_size=uncompressed.bytes_written)
