"""The clock the autoscaler's loops take, and a fake one for tests (STYLE.md, principle 4).

Policies never read a clock: they take ``now_s``. The controller holds a ``Clock`` and passes
``clock.now_s()`` in, so a test moves time with ``FakeClock.advance`` instead of sleeping.

    >>> clock = FakeClock(start_s=100.0)
    >>> clock.advance(5.0)
    >>> clock.now_s()
    105.0
"""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds: only differences between two readings mean anything."""

    def now_s(self) -> float:
        ...


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = float(start_s)

    def now_s(self) -> float:
        return self._now_s

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` (never backward: a monotonic clock does not)."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back {-seconds} s")
        self._now_s += seconds


class MonotonicClock:
    """The process's monotonic clock, for the controller's main.

    The one place in ``autoscale`` that touches the system: ``time`` is imported inside the
    method so that importing the package never pulls it in (tests check this).
    """

    def now_s(self) -> float:
        import time  # the single allowed system call in the package; see the class docstring

        return time.monotonic()
