"""A spinner with the elapsed time for the CLI steps a person waits on (starting the platform,
building a demo model, waiting for deploy runs).

On a terminal it redraws one line in place; lines printed meanwhile through the same console
appear above it. Anywhere else (a pipe, a log file, CI) it prints the step's description once
and nothing more, so logs get no spinner frames.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


@contextmanager
def waiting(console: Console, description: str) -> Iterator[Callable[[str], None]]:
    """Show ``description`` with a spinner and the time elapsed until the block ends; yields a
    function that replaces the description (e.g. with what the step is doing now)."""
    if not console.is_terminal:
        console.print(f"{description}…", highlight=False)
        yield lambda _text: None
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task(description, total=None)
        yield lambda text: progress.update(task, description=text)
