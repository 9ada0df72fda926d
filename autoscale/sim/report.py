"""Figures of one simulated run, and the day's table and plot: pure functions of ``FleetRun``s.

Per policy: replica-hours (ready + starting), the saving against static peak, the multiple of
the oracle's replica-hours, the share of requests within the SLO, the requests served past
it (queued or slowed) and rejected, scale events (changes of the ordered count), direction
reversals (up then down then up, or the reverse, within 5 minutes; those on a steady stretch
are counted apart), and the time to capacity after the ramp.
"""

from __future__ import annotations

import numpy as np

from autoscale.sim.fleet import FleetRun, ticks_to_capacity, within_slo

REVERSAL_WINDOW_S = 300.0
STEADY_MAX_OVER_MIN = 1.25  # a stretch whose 10 s mean arrivals vary less than this is steady


def _changes(desired: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tick, direction ±1) of every change of the ordered count."""
    step = np.diff(desired)
    ticks = np.nonzero(step)[0] + 1
    return ticks, np.sign(step[ticks - 1]).astype(int)


def reversals(run: FleetRun, window_s: float = REVERSAL_WINDOW_S) -> tuple[list[int], list[int]]:
    """(all, steady) start ticks of up-down-up or down-up-down within ``window_s``.

    Three consecutive changes of the ordered count whose directions alternate and which all
    fall within ``window_s``; steady when the arrivals' 10 s means over those ticks stay
    within ``STEADY_MAX_OVER_MIN`` of each other.
    """
    ticks, directions = _changes(run.desired)
    tick_s = run.demand.tick_s
    found, steady = [], []
    bucket = max(int(round(10 / tick_s)), 1)
    for k in range(len(ticks) - 2):
        if directions[k] == -directions[k + 1] == directions[k + 2] and (ticks[k + 2] - ticks[k]) * tick_s <= window_s:
            found.append(int(ticks[k]))
            span = run.demand.arrivals[ticks[k]:ticks[k + 2] + 1]
            means = np.add.reduceat(span, np.arange(0, len(span), bucket)) / bucket
            if len(means) and means.min() > 0 and means.max() / means.min() <= STEADY_MAX_OVER_MIN:
                steady.append(int(ticks[k]))
    return found, steady


def figures(run: FleetRun, *, static_replica_hours: float | None, oracle_replica_hours: float | None) -> dict:
    """One row of the day table (JSON-ready)."""
    within, past = within_slo(run)
    arrivals = int(run.demand.arrivals.sum())
    rejected = int(run.rejected.sum())
    hours = run.replica_seconds / 3600.0
    found, steady = reversals(run)
    changes, _ = _changes(run.desired)
    row = {"policy": run.policy, "replica_hours": round(hours, 1),
           "saving_vs_static_peak": None if not static_replica_hours else round(1 - hours / static_replica_hours, 4),
           "x_oracle": None if not oracle_replica_hours else round(hours / oracle_replica_hours, 3),
           "requests": arrivals, "within_slo": round(within / arrivals, 6) if arrivals else None,
           "served_past_slo": int(round(past)), "rejected": rejected, "queued_at_end": run.queued_at_end,
           "scale_events": int(len(changes)), "reversals_5min": len(found), "reversals_5min_steady": len(steady),
           "peak_replicas": int((run.ready + run.starting).max()), "conservation_error": run.conservation_error}
    if run.demand.ramp_at_s is not None:
        start = int(run.demand.ramp_at_s / run.demand.tick_s)
        ticks = ticks_to_capacity(run, start)
        row["time_to_capacity_after_ramp_s"] = None if ticks is None else ticks * run.demand.tick_s
    return row


def table_markdown(rows: list[dict]) -> str:
    """The day table as Markdown, one row per policy."""
    head = ("| policy | replica-hours | × oracle | saving vs static | within SLO | past SLO | rejected | "
            "scale events | reversals (steady) | ramp → capacity |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        ramp = r.get("time_to_capacity_after_ramp_s")
        saving = r["saving_vs_static_peak"]
        x_oracle = "–" if r["x_oracle"] is None else f"{r['x_oracle']:.2f}"
        lines.append(f"| {r['policy']} | {r['replica_hours']:,.0f} | {x_oracle} | "
                     f"{'' if saving is None else f'{saving:.1%}'} | {r['within_slo']:.4%} | {r['served_past_slo']:,} | "
                     f"{r['rejected']:,} | {r['scale_events']} | {r['reversals_5min']} ({r['reversals_5min_steady']}) | "
                     f"{'never' if ramp is None else f'{ramp:.0f} s'} |")
    return "\n".join(lines)


PLOTTED = ("static_peak", "hpa", "knative_kpa", "modelplane_two_axes_predictive", "oracle")


def plot_day(runs: list[FleetRun], path: str, title: str, policies: tuple[str, ...] = PLOTTED) -> None:
    """Demand, and the replicas (ready + starting) of ``policies`` over the day and around the ramp, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [run for run in runs if run.policy in policies] or runs
    demand = runs[0].demand
    hours = np.arange(demand.ticks) * demand.tick_s / 3600
    ramp_h = None if demand.ramp_at_s is None else demand.ramp_at_s / 3600
    panels = 3 if ramp_h is not None else 2
    figure, axes = plt.subplots(panels, 1, figsize=(12, 3.2 * panels), height_ratios=(1, 2, 2)[:panels])
    axes[0].plot(hours, demand.arrivals / demand.tick_s / 1000, color="black", linewidth=0.5)
    axes[0].set_ylabel("demand (k req/s)")
    axes[0].set_title(title)
    windows = [(axes[1], slice(None), "hour of the day")]
    if ramp_h is not None:
        start, end = int((ramp_h - 0.1) * 3600 / demand.tick_s), int((ramp_h + 0.4) * 3600 / demand.tick_s)
        windows.append((axes[2], slice(start, end), "hour of the day (around the 10× ramp)"))
    for axis, window, label in windows:
        for run in shown:
            axis.plot(hours[window], (run.ready + run.starting)[window], linewidth=0.8, label=run.policy)
        axis.set_ylabel("replicas (ready + starting)")
        axis.set_xlabel(label)
    axes[1].legend(fontsize=8, ncol=3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
