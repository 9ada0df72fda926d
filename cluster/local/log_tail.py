"""The end of what a replica's process wrote in its current life: the reason it gives when it
exits while starting (a Python traceback ends with the exception), which goes into the replica's
``last_error`` and from there into the deploy step that waited for it."""

from __future__ import annotations

from pathlib import Path


def log_size(path: Path) -> int:
    """Where a new life's output begins in ``path`` (0 when there is no log yet)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def log_tail(path: Path, offset: int = 0, lines: int = 6, max_chars: int = 1200) -> str:
    """The last ``lines`` non-blank lines written to ``path`` after ``offset``, joined by " | ",
    at most ``max_chars`` (their end kept); "" when there are none.

    >>> import tempfile
    >>> log = Path(tempfile.mkdtemp()) / "r.log"
    >>> _ = log.write_text("earlier life\\n")
    >>> start = log_size(log)
    >>> _ = log.open("a").write("Traceback (most recent call last):\\n  File 'x'\\n\\nValueError: no such column\\n")
    >>> log_tail(log, start, lines=2)
    "File 'x' | ValueError: no such column"
    >>> log_tail(log.with_name("none.log"))
    ''
    """
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            text = handle.read()[-64 * 1024:].decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[-max_chars:]
