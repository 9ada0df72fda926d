"""Replica log files of the local cluster backend: find them, read their last lines, follow them.

The supervisor appends each replica's output (every restart too) to
``$MODELPLANE_HOME/logs/replicas/<replica id>.log``, where a replica id is
``<revision id>-<index>``. ``modelplane logs`` reads them from here; nothing in this module
touches the database.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

BLOCK_BYTES = 64 * 1024


def replica_logs(replicas_dir: Path, revision_ids: Sequence[str]) -> list[tuple[str, Path]]:
    """``(replica id, path)`` of every log file of these revisions, in the revisions' order, then by index.

    A revision id ends in 8 random hex digits, so ``<revision id>-<n>.log`` matches no other revision's files.
    """
    found = []
    for revision_id in revision_ids:
        pattern = re.compile(re.escape(revision_id) + r"-(\d+)\.log")
        matches = [(int(m.group(1)), path) for path in replicas_dir.glob(f"{revision_id}-*.log")
                   if (m := pattern.fullmatch(path.name))]
        found += [(path.name.removesuffix(".log"), path) for _, path in sorted(matches)]
    return found


def last_lines(path: Path, count: int) -> list[str]:
    """The last ``count`` lines of a file (without their newlines), read from its end, so a
    large log costs no more than the lines asked for.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
    ...     _ = f.write("one\\ntwo\\nthree\\n")
    >>> last_lines(Path(f.name), 2), last_lines(Path(f.name), 0)
    (['two', 'three'], [])
    """
    if count <= 0:
        return []
    with path.open("rb") as file:
        file.seek(0, os.SEEK_END)
        position = file.tell()
        data = b""
        while position > 0 and data.count(b"\n") <= count:
            step = min(BLOCK_BYTES, position)
            position -= step
            file.seek(position)
            data = file.read(step) + data
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[-count:]


class Tail:
    """New complete lines of a set of files since the last :meth:`read`, like ``tail -f``.

    A file starts at its end when added (what was there is printed separately), a line still
    being written is held until its newline, and a file that shrank (truncated or replaced) is
    read again from its start.
    """

    def __init__(self) -> None:
        self._offsets: dict[Path, int] = {}
        self._names: dict[Path, str] = {}
        self._partial: dict[Path, bytes] = {}

    def add(self, name: str, path: Path, from_start: bool = False) -> None:
        if path in self._offsets:
            return
        self._names[path] = name
        self._offsets[path] = 0 if from_start else _size(path)
        self._partial[path] = b""

    def paths(self) -> set[Path]:
        return set(self._offsets)

    def read(self) -> list[tuple[str, str]]:
        """``(name, line)`` of every line completed since the last read, file by file."""
        lines = []
        for path, offset in self._offsets.items():
            size = _size(path)
            if size < offset:  # truncated or replaced: start over
                offset, self._partial[path] = 0, b""
            if size == offset:
                continue
            with path.open("rb") as file:
                file.seek(offset)
                data = self._partial[path] + file.read(size - offset)
            self._offsets[path] = size
            *complete, self._partial[path] = data.split(b"\n")
            lines += [(self._names[path], line.decode("utf-8", errors="replace").rstrip("\r")) for line in complete]
        return lines


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def follow(tail: Tail, discover: Callable[[], Iterable[tuple[str, Path]]], stop: Callable[[], bool],
           sleep: Callable[[float], None], interval_s: float = 0.5,
           discover_every: int = 4) -> Iterator[tuple[str, str]]:
    """Yield ``(replica id, line)`` as lines arrive, until ``stop()``; every ``discover_every``
    polls ask ``discover`` for files to add (a replica started by a scale-up or a rollout), whose
    lines are followed from their start."""
    polls = 0
    while not stop():
        if polls % discover_every == 0:
            for name, path in discover():
                if path not in tail.paths():
                    tail.add(name, path, from_start=polls > 0)
        yield from tail.read()
        polls += 1
        sleep(interval_s)
