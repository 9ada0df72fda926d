"""The FUSE daemon process: ``python -m images.mount.daemon --mode file|dir ...``.

Its parent (:class:`images.mount.process.FuseProcess`) starts it and waits on it. It opens the
source from a JSON spec (:func:`images.mount.sources.open_source`), then serves FUSE in the
foreground until the mount goes away (``fusermount3 -u``) or it gets SIGTERM/SIGINT, which
libfuse turns into an orderly unmount.

It runs in its own process because a FUSE server must never be a process that also reads
through its own mount (a page fault on the mount would wait for the very thread that
serves it), and because a kernel mount outlives whatever Python state created it.

With ``--stats-file`` it writes the source's ``stats()`` there as JSON on SIGUSR1 and at
exit; SIGUSR2 starts the background fill of a registry source opened with ``fill: signal``.
libfuse's loop blocks the main thread in C, where Python signal handlers never run, so both
signals are blocked in every thread and one thread waits for them with ``sigwait``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from images.mount.sources import open_source
from images.source import BlockSource


def stats_of(source: BlockSource) -> dict:
    """The source's ``stats()`` as a JSON-able dict (``{}`` where it keeps none).

    >>> class Counting:
    ...     def stats(self): return {"reads": 3}
    >>> stats_of(Counting())
    {'reads': 3}
    """
    stats = getattr(source, "stats", None)
    if not callable(stats):
        return {}
    value = stats()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return dict(value) if isinstance(value, dict) else {"stats": repr(value)}


def write_stats(source: BlockSource, path: Path) -> None:
    """Replace ``path`` with the stats atomically: a reader never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(stats_of(source), default=str, sort_keys=True))
    os.replace(partial, path)


def _answer_signals(source: BlockSource, path: Path | None) -> None:
    """SIGUSR1: write the stats file; SIGUSR2: start filling the rest of the image."""
    while True:
        received = signal.sigwait({signal.SIGUSR1, signal.SIGUSR2})
        try:
            if received == signal.SIGUSR2:
                fill = getattr(source, "start_background_fill", None)
                if callable(fill):
                    fill()
            elif path is not None:
                write_stats(source, path)
        except Exception:  # noqa: BLE001 - a failed stats write or fill must not take the mount down
            logging.getLogger("modelplane.images.mount").exception("answering signal %s failed", received)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m images.mount.daemon", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["file", "dir"], required=True,
                        help="file: one file 'image' holding the source's bytes; dir: the squashfs tree")
    parser.add_argument("--source-spec", required=True, help="JSON, see images.mount.sources.open_source")
    parser.add_argument("--mountpoint", required=True)
    parser.add_argument("--stats-file", type=Path, help="write the source's stats() here on SIGUSR1 and at exit")
    parser.add_argument("--allow-other", action="store_true", help="let users other than the mounting one read")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    # Blocked before any thread starts (the fetcher's pool during a prefetch, libfuse's), so
    # every thread inherits the mask: a signal delivered to a thread that does not block it
    # would take its default action, which ends the process.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
    source = open_source(json.loads(args.source_spec))
    try:
        threading.Thread(target=_answer_signals, args=(source, args.stats_file), name="signals", daemon=True).start()
        if args.mode == "file":
            from images.mount.fuse_file import serve_file

            serve_file(source, args.mountpoint, allow_other=args.allow_other)
        else:
            from images.mount.fuse_dir import serve_tree
            from images.mount.reader import SquashReader

            serve_tree(SquashReader(source), args.mountpoint, allow_other=args.allow_other)
    finally:
        try:
            if args.stats_file is not None:
                write_stats(source, args.stats_file)
        finally:
            source.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
