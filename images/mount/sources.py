"""Open the BlockSource a mount daemon serves from a JSON-able spec.

The daemon is a separate process, so it is handed a description of its source, not the
object. Kinds:

- ``{"kind": "file", "path": ...}``: a local image file (:class:`~images.source.FileSource`).
  ``"unreadable_ranges": [[offset, length], ...]`` makes those bytes answer EIO, so the
  failure path of every front end can be drilled end to end, kernel included.
- ``{"kind": "registry", "url", "repo", "index_digest", "cache_root", "max_cache_bytes"?,
  "prefetch"?, "fill"?, "max_request_bytes"?}``: the lazy fetcher over an OCI registry
  (``prefetch``: wait | background (true) | false; ``fill``: now | signal | off). Credentials come from the
  environment (``MODELPLANE_REGISTRY_USERNAME`` / ``_PASSWORD``), never from the spec, which
  shows up in ``ps``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

from images.source import BlockSource, FileSource

USERNAME_ENV = "MODELPLANE_REGISTRY_USERNAME"
PASSWORD_ENV = "MODELPLANE_REGISTRY_PASSWORD"


class UnreadableRanges:
    """A BlockSource whose reads touching any of ``ranges`` (offset, length) raise EIO.

    Stands in for a registry that lost a sector or a cache whose digest check failed:
    the bytes cannot be had, and the contract says EIO, never wrong bytes.

    >>> class Bytes:
    ...     size = 10
    ...     def read(self, offset, length): return bytes(range(offset, min(offset + length, 10)))
    ...     def close(self): pass
    >>> source = UnreadableRanges(Bytes(), [(4, 2)])
    >>> source.read(0, 4)
    b'\\x00\\x01\\x02\\x03'
    >>> source.read(3, 2)
    Traceback (most recent call last):
    OSError: [Errno 5] bytes 4..6 of the source are unreadable
    """

    def __init__(self, inner: BlockSource, ranges: Iterable[tuple[int, int]]) -> None:
        self.inner = inner
        self.size = inner.size
        self.ranges = [(int(offset), int(length)) for offset, length in ranges]
        self.failed_reads = 0

    def read(self, offset: int, length: int) -> bytes:
        for start, bad_length in self.ranges:
            if offset < start + bad_length and start < offset + length:
                self.failed_reads += 1
                raise OSError(errno.EIO, f"bytes {start}..{start + bad_length} of the source are unreadable")
        return self.inner.read(offset, length)

    def stats(self) -> dict:
        return {"failed_reads": self.failed_reads}

    def close(self) -> None:
        self.inner.close()


def open_source(spec: dict) -> BlockSource:
    """The BlockSource described by ``spec`` (see the module docstring for the kinds)."""
    kind = spec.get("kind")
    if kind == "file":
        source: BlockSource = FileSource(Path(spec["path"]))
        if spec.get("unreadable_ranges"):
            source = UnreadableRanges(source, spec["unreadable_ranges"])
        return source
    if kind == "registry":
        return _open_registry(spec)
    raise ValueError(f"unknown source kind {kind!r}: expected 'file' or 'registry'")


def _open_registry(spec: dict) -> BlockSource:
    # Imported here: the fetcher and the HTTP client are not needed to mount a local file.
    from images.lazy.fetcher import open_lazy
    from images.oci.client import HttpRegistry

    # 5 s without a byte fails a request (a stopped registry), however slow the link: the
    # timeout bounds each read of the socket, not the transfer
    registry = HttpRegistry(spec["url"], username=os.environ.get(USERNAME_ENV), password=os.environ.get(PASSWORD_ENV),
                            timeout_s=float(spec.get("registry_timeout_s", 5.0)))
    max_cache_bytes = spec.get("max_cache_bytes")
    image = open_lazy(registry, spec["repo"], spec["index_digest"], Path(spec["cache_root"]),
                      max_cache_bytes=None if max_cache_bytes is None else int(max_cache_bytes),
                      # 8 MiB runs: a start-up read waits for its own sectors, not for 32 MiB
                      # merged behind them on a slow link
                      max_request_bytes=int(spec.get("max_request_bytes", 8 << 20)))
    prefetch = spec.get("prefetch", False)
    if prefetch not in (True, False, "wait", "background"):
        raise ValueError(f"prefetch must be wait, background or false, not {prefetch!r}")
    if prefetch:
        # The start-up set, in the order the runtime read it: "wait" fetches it before the mount
        # appears; "background" (true) mounts at once and streams it while the runtime starts,
        # so the link and the CPU work at the same time (the runtime's reads wait only for
        # sectors not there yet, never fetch one twice).
        image.prefetch(image.index.prefetch, wait=prefetch == "wait")
    # Then everything else, in the background: at once ("now"), when the daemon is sent
    # SIGUSR2 ("signal": the supervisor sends it once the replica is ready, so the fill does not
    # compete with the start-up reads for the link), or never ("off").
    fill = spec.get("fill", "now" if spec.get("prefetch") else "off")
    if fill not in ("now", "signal", "off"):
        raise ValueError(f"fill must be now, signal or off, not {fill!r}")
    if fill == "now":
        image.start_background_fill()
    return image
