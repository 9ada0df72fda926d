"""Running two servers in turn, several times, and saying how much a figure moved.

On a shared machine one run of A and one of B can differ by background load alone; runs
alternate (A B, B A, A B …) so that drift falls on both, and every figure is given as
min / median / max of the repeats. A ratio is taken within each repeat (A's run against
the B run next to it), then summarised the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence


def alternate(runs: dict[str, Callable[[], dict]], repeats: int, log: Callable[[str], None] = print) -> dict[str, list]:
    """``{name: [result of repeat 1, 2, …]}``; the order of the names flips every repeat."""
    names = list(runs)
    results: dict[str, list] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else list(reversed(names)):
            log(f"repeat {repeat + 1}/{repeats}: {name}")
            results[name].append(runs[name]())
    return results


def spread(values: Sequence[float]) -> dict[str, float]:
    """min / median / max, rounded for reports.

    >>> spread([1.0, 3.0, 2.0])
    {'min': 1.0, 'median': 2.0, 'max': 3.0, 'n': 3}
    """
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3),
            "max": round(max(values), 3), "n": len(values)}


def ratios(ours: Sequence[float], anchor: Sequence[float]) -> list[float]:
    """Repeat-by-repeat ratios; a repeat whose anchor measured nothing gives 0 (never infinity).

    >>> ratios([10.0, 12.0], [5.0, 0.0])
    [2.0, 0.0]
    """
    return [o / a if a > 0 else 0.0 for o, a in zip(ours, anchor)]
