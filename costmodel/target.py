"""The operating point a cost model prices at: the highest swept concurrency whose every point
holds the endpoint's SLO (:func:`target_concurrency`), or the lowest level, said to miss it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.sweep import SweepError, SweepPoint

MAX_FAILED_FRACTION = 0.01  # a failed request is slower than any SLO: over 1 % of them breaks a p99


@dataclass(frozen=True)
class TargetConcurrency:
    """The operating point chosen from the sweep, and why."""

    concurrency: int
    slo_met: bool
    message: str


def _level_shortfall(points: Sequence[SweepPoint], slo_p99_ms: float, slo_ttft_ms: float | None) -> str | None:
    """Why a level's points miss the SLO, or None when every point holds it."""
    n_failed = sum(p.n_failed for p in points)
    n_total = n_failed + sum(p.n_ok for p in points)
    if n_failed > MAX_FAILED_FRACTION * n_total:
        return f"{n_failed} of {n_total} requests failed"
    worst = max(points, key=lambda p: p.p99_latency_ms if math.isfinite(p.p99_latency_ms) else math.inf)
    if not worst.p99_latency_ms <= slo_p99_ms:
        return (f"the p99 latency is {worst.p99_latency_ms:.0f} ms > {slo_p99_ms:g} ms "
                f"(input {worst.input_tokens}, output {worst.output_tokens} tokens)")
    if slo_ttft_ms is not None:
        if any(p.p99_ttft_ms is None for p in points if p.n_ok):
            return "no time to first token was measured (stream the answers to measure it)"
        worst = max((p for p in points if p.n_ok), key=lambda p: p.p99_ttft_ms)
        if not worst.p99_ttft_ms <= slo_ttft_ms:
            return (f"the p99 time to first token is {worst.p99_ttft_ms:.0f} ms > {slo_ttft_ms:g} ms "
                    f"(input {worst.input_tokens}, output {worst.output_tokens} tokens)")
    return None


def target_concurrency(points: Sequence[SweepPoint], slo_p99_ms: float,
                       slo_ttft_ms: float | None = None) -> TargetConcurrency:
    """The highest swept concurrency at which every point holds the SLO.

    A level holds it when the worst p99 latency of its points is ≤ ``slo_p99_ms``, the worst
    p99 TTFT ≤ ``slo_ttft_ms`` (when given), and at most 1 % of its requests failed. When no
    level holds it the answer is the lowest swept level with ``slo_met=False``: never a
    guess beyond the sweep. Levels whose p99 is 120, 300 and 900 ms against an SLO of 500 ms
    give the middle one.
    """
    if not (math.isfinite(slo_p99_ms) and slo_p99_ms > 0):
        raise ValueError(f"slo_p99_ms must be a positive number of ms, got {slo_p99_ms}")
    if slo_ttft_ms is not None and not (math.isfinite(slo_ttft_ms) and slo_ttft_ms > 0):
        raise ValueError(f"slo_ttft_ms must be a positive number of ms or None, got {slo_ttft_ms}")
    levels = sorted({p.concurrency for p in points})
    if not levels:
        raise SweepError("there are no sweep points to choose a target concurrency from; run the sweep first")
    slo = f"p99 ≤ {slo_p99_ms:g} ms" + (f", p99 TTFT ≤ {slo_ttft_ms:g} ms" if slo_ttft_ms is not None else "")
    shortfalls = {c: _level_shortfall([p for p in points if p.concurrency == c], slo_p99_ms, slo_ttft_ms)
                  for c in levels}
    holding = [c for c in levels if shortfalls[c] is None]
    if not holding:
        return TargetConcurrency(levels[0], False,
                                 f"no swept concurrency holds the SLO ({slo}): even at concurrency {levels[0]} "
                                 f"{shortfalls[levels[0]]}; relax the SLO, send shorter requests or serve on "
                                 f"faster hardware (priced at concurrency {levels[0]} meanwhile)")
    best = max(holding)
    worst_p99_ms = max(p.p99_latency_ms for p in points if p.concurrency == best)
    message = (f"concurrency {best} is the highest swept level that holds the SLO ({slo}); its worst p99 "
               f"latency is {worst_p99_ms:.0f} ms")
    above = [c for c in levels if c > best]
    if above:
        message += f"; at concurrency {above[0]} {shortfalls[above[0]]}"
    return TargetConcurrency(best, True, message)
