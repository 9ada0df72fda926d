"""An endpoint's last day as one small PNG: replicas the autoscaler set against the demand it saw.

A pure function of plain data (the decisions' times and replica counts, the stored peak in
flight per wall-clock minute, as ``controlplane.scaling.ScalingStore`` keeps them), drawn with
matplotlib's Agg canvas on a private Figure, like ``costmodel.plot``; it lives here, not in
``autoscale``, whose policy modules import nothing that does I/O. The x axis is hours before
``now_s``; replicas are a step line (a decision holds until the next one), demand the
peak requests in flight of each minute, on an axis of its own. With the target concurrency,
demand ÷ target (the replicas that demand needs) is drawn on the replicas' axis too.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DAY_S = 24 * 3600.0
MINUTE_S = 60.0
FIGURE_SIZE_IN = (8.0, 3.2)
DPI = 80


def replica_steps(decisions: Sequence[tuple[float, int]], now_s: float, window_s: float,
                  before: int | None = None) -> tuple[list[float], list[int]]:
    """Hours before ``now_s`` and replica counts of a step line across the window.

    ``decisions``: (wall time in s, replicas set), any order; ``before``: the count the window
    opened with (the newest decision older than it), if known.

    >>> replica_steps([(7200.0, 2), (3600.0, 1)], now_s=10800.0, window_s=10800.0, before=None)
    ([-2.0, -1.0, 0.0], [1, 2, 2])
    """
    start = now_s - window_s
    inside = sorted((t, r) for t, r in decisions if start <= t <= now_s)
    hours, replicas = [], []
    if before is not None:
        hours.append(-window_s / 3600.0)
        replicas.append(before)
    for t, r in inside:
        hours.append((t - now_s) / 3600.0)
        replicas.append(r)
    if replicas:
        hours.append(0.0)
        replicas.append(replicas[-1])
    return hours, replicas


def replicas_vs_demand_png(decisions: Sequence[tuple[float, int]], demand_by_minute: Mapping[int, float],
                           now_s: float, window_s: float = DAY_S, target_concurrency: float | None = None,
                           title: str = "") -> bytes:
    """PNG bytes, 640 × 256 pixels. Decisions before the window set its opening count."""
    older = [d for d in decisions if d[0] < now_s - window_s]
    before = max(older)[1] if older else None
    hours, replicas = replica_steps(decisions, now_s, window_s, before)
    figure = Figure(figsize=FIGURE_SIZE_IN, dpi=DPI)
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    if hours:
        axes.step(hours, replicas, where="post", color="C0", label="replicas set")
    minutes = sorted(m for m in demand_by_minute if now_s - window_s <= m * MINUTE_S <= now_s)
    demand_hours = [(m * MINUTE_S - now_s) / 3600.0 for m in minutes]
    demand = [demand_by_minute[m] for m in minutes]
    if target_concurrency and demand:
        axes.plot(demand_hours, [d / target_concurrency for d in demand], color="C1", linestyle="--", linewidth=0.8,
                  label=f"demand ÷ target concurrency {target_concurrency:g}")
    axes.set_xlim(-window_s / 3600.0, 0.0)
    axes.set_ylim(bottom=0)
    axes.set_xlabel("hours before now")
    axes.set_ylabel("replicas")
    right = axes.twinx()
    if demand:
        right.plot(demand_hours, demand, color="C2", alpha=0.5, linewidth=0.8, label="peak in flight per minute")
    right.set_ylim(bottom=0)
    right.set_ylabel("requests in flight (peak per minute)")
    handles = axes.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    if handles:
        axes.legend(handles=handles, fontsize=6, loc="upper left")
    axes.set_title(title or "replicas against demand", fontsize=9)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
