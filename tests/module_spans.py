"""Where a parallel run's wall time went, by test module: each module's span (its first test's
start to its last test's end, set-ups and teardowns included) and the worker it ran on, so a
CI log shows which modules make the run's critical path (docs/testing.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Span:
    module: str
    worker: str
    start_s: float
    stop_s: float

    @property
    def seconds(self) -> float:
        return self.stop_s - self.start_s


def spans(reports: list[tuple[str, str, float, float]]) -> list[Span]:
    """``(nodeid, worker, start, stop)`` of each phase report -> one span per module, longest first."""
    found: dict[str, Span] = {}
    for nodeid, worker, start, stop in reports:
        module = nodeid.split("::", 1)[0]
        span = found.setdefault(module, Span(module, worker, start, stop))
        span.start_s, span.stop_s = min(span.start_s, start), max(span.stop_s, stop)
    return sorted(found.values(), key=lambda span: span.seconds, reverse=True)


def summary(reports: list[tuple[str, str, float, float]], top: int = 15) -> list[str]:
    """The lines printed at the end of a run: the ``top`` longest modules, each with its span,
    its worker and when it started and ended, in seconds from the run's first test."""
    found = spans(reports)
    if not found:
        return []
    began = min(span.start_s for span in found)
    lines = [f"{span.seconds:8.1f}s  {span.worker:>5}  {span.start_s - began:7.1f} -> {span.stop_s - began:7.1f}  "
             f"{span.module}" for span in found[:top]]
    return [f"the {min(top, len(found))} longest modules of {len(found)} (span, worker, from -> to in s):", *lines]
