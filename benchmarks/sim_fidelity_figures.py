"""What ``benchmarks/sim_fidelity.py`` measures, turned into figures and judged: pure functions (no process).

The demand it replays, the rows cost model it fits, the simulator's latencies, and the
comparison of the two sides (``compare``, ``verdict``), so that ``tests/test_sim_fidelity.py``
checks them without starting a replica.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoscale.sim.demand import DEFAULT_TRACE, Demand, Trace
from costmodel.fit import Coefficients, CostModel
from costmodel.target import target_concurrency
from costmodel.sweep import RequestSample, SweepPoint

GOAL_LOW, GOAL_HIGH = 0.67, 1.5
GOAL_REPLICAS_MEAN_ABS = 0.5
GOAL = (f"predicted p99 / measured p99 within [{GOAL_LOW}, {GOAL_HIGH}] over the run and in each phase, and ready "
        f"replicas within {GOAL_REPLICAS_MEAN_ABS} on average (simulator vs real local replicas)")
SERVICE_TIME_MS = 50.0
MAX_ROWS = 4
SWEEP_LEVELS = (1, 2, 4)
SLO_P99_MS = 500.0
MIN_REPLICAS, MAX_REPLICAS, TARGET_CONCURRENCY = 1, 3, 2
TRACE_CSV = DEFAULT_TRACE


@dataclass(frozen=True)
class Timing:
    duration_s: int
    step_at_s: int
    step_end_s: int
    base_rps: float
    step_factor: float
    sweep_s: float
    lookback_s: float
    seed: int = 0


QUICK = Timing(duration_s=120, step_at_s=30, step_end_s=75, base_rps=4.0, step_factor=3.5, sweep_s=6.0,
               lookback_s=20.0)
FULL = Timing(duration_s=240, step_at_s=60, step_end_s=150, base_rps=4.0, step_factor=3.5, sweep_s=12.0,
              lookback_s=30.0)



def rows_for(context_tokens: np.ndarray, median_context: float, max_rows: int = MAX_ROWS) -> np.ndarray:
    """A trace request's size in service-time rows: ``clamp(ceil(tokens / median), 1, max_rows)``.

        >>> rows_for(np.array([10, 1020, 1021, 99999]), 1020.0).tolist()
        [1, 1, 2, 4]
    """
    if not median_context > 0:
        raise ValueError(f"the median context length must be positive, got {median_context}")
    return np.clip(np.ceil(np.asarray(context_tokens) / median_context), 1, max_rows).astype(np.int64)


@dataclass(frozen=True)
class FidelityDemand:
    """Arrivals per second, each request's size (rows, in arrival order) and its send time (s)."""

    arrivals: np.ndarray
    rows: np.ndarray
    send_at_s: np.ndarray
    description: str

    def to_sim(self) -> Demand:
        """The simulator's demand: the same counts; sizes as input tokens = rows, output tokens 0."""
        return Demand(self.arrivals.astype(np.int64), self.rows.astype(np.int64), np.zeros(len(self.rows), np.int64),
                      self.description)


def fidelity_demand(trace: Trace, timing: Timing) -> FidelityDemand:
    """The trace's first ``duration_s`` seconds of per-second counts, scaled to a mean of ``base_rps``,
    × ``step_factor`` in [step_at_s, step_end_s); Poisson counts; sizes of the trace's requests in order."""
    if not 0 <= timing.step_at_s <= timing.step_end_s <= timing.duration_s:
        raise ValueError(f"need 0 ≤ step_at_s ≤ step_end_s ≤ duration_s, got {timing}")
    rng = np.random.default_rng(timing.seed)
    counts = np.bincount(np.floor(trace.arrival_s).astype(np.int64), minlength=timing.duration_s)[:timing.duration_s]
    mean = counts.mean()
    if mean <= 0:
        raise ValueError(f"{trace.source}: no arrivals in its first {timing.duration_s} s")
    rate = counts * (timing.base_rps / mean)
    rate[timing.step_at_s:timing.step_end_s] *= timing.step_factor
    arrivals = rng.poisson(rate).astype(np.int64)
    total = int(arrivals.sum())
    all_rows = rows_for(trace.input_tokens, float(np.median(trace.input_tokens)))
    rows = np.resize(all_rows, total)  # the trace's requests in order (wrapping if the run needs more)
    send_at = np.concatenate([np.sort(t + rng.uniform(0, 1, n)) for t, n in enumerate(arrivals)]) if total \
        else np.zeros(0)
    description = (f"{Path(trace.source).name}: per-second counts of its first {timing.duration_s} s, scaled to a "
                   f"mean of {timing.base_rps:g} req/s, × {timing.step_factor:g} from {timing.step_at_s} s to "
                   f"{timing.step_end_s} s, Poisson counts (seed {timing.seed}), uniform within each second; "
                   f"rows = clamp(ceil(ContextTokens / median {np.median(trace.input_tokens):g}), 1, {MAX_ROWS})")
    return FidelityDemand(arrivals, rows, send_at, description)


def fit_rows_level(samples: list[RequestSample], concurrency: int) -> Coefficients:
    """``latency = α·rows + γ`` at one level by least squares over its successful samples (α, γ ≥ 0).

    Rows are the samples' ``input_tokens``; β (per output token) is 0.

        >>> s = [RequestSample(r, 0, 2, 100.0 * r + 40.0, None, True) for r in (1, 2, 3, 4)]
        >>> c = fit_rows_level(s, 2); round(c.alpha_ms_per_input_token, 6), round(c.gamma_ms, 6)
        (100.0, 40.0)
    """
    ok = [s for s in samples if s.ok and s.concurrency == concurrency]
    if not ok:
        raise ValueError(f"no successful request at concurrency {concurrency}")
    rows = np.array([s.input_tokens for s in ok], dtype=float)
    latency = np.array([s.latency_ms for s in ok])
    if len(set(rows.tolist())) < 2:
        return Coefficients(0.0, 0.0, float(latency.mean()), concurrency)
    alpha, gamma = np.linalg.lstsq(np.column_stack([rows, np.ones_like(rows)]), latency, rcond=None)[0]
    if gamma < 0:  # keep both ≥ 0: refit through the origin
        alpha, gamma = float((rows @ latency) / (rows @ rows)), 0.0
    if alpha < 0:
        alpha, gamma = 0.0, float(latency.mean())
    return Coefficients(float(alpha), 0.0, float(gamma), concurrency)


def rows_cost_model(samples: list[RequestSample], points: list[SweepPoint], slo_p99_ms: float) -> CostModel:
    """The ``CostModel`` of a sweep of row counts: one ``fit_rows_level`` per level, the target from
    ``costmodel.fit.target_concurrency``; r² over all samples (no hold-out)."""
    levels = {c: fit_rows_level(samples, c) for c in sorted({s.concurrency for s in samples if s.ok})}
    target = target_concurrency(points, slo_p99_ms)
    ok = [s for s in samples if s.ok]
    measured = np.array([s.latency_ms for s in ok])
    predicted = np.array([levels[s.concurrency].latency_ms(s.input_tokens, 0) for s in ok])
    ss_tot = float(((measured - measured.mean()) ** 2).sum())
    r2 = 1.0 - float(((measured - predicted) ** 2).sum()) / ss_tot if ss_tot > 0 else math.nan
    return CostModel(levels=levels, target_concurrency=target.concurrency, slo_met=target.slo_met,
                     slo_message=target.message, r2=r2, heldout_median_abs_pct_error=math.nan, n_samples=len(ok),
                     kind="llm", slo_p99_ms=slo_p99_ms)


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """Nearest rank with weights: the smallest value whose cumulative weight reaches q × the total
    (with unit weights, ``costmodel.sweep.nearest_rank_percentile``); nan with no weight."""
    if not 0 < q <= 1:
        raise ValueError(f"percentile q must be in (0, 1], got {q}")
    values, weights = np.asarray(values, dtype=float), np.asarray(weights, dtype=float)
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    if not len(values):
        return math.nan
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    index = int(np.searchsorted(cumulative, q * cumulative[-1] * (1 - 1e-12), side="left"))
    return float(values[order][min(index, len(values) - 1)])


def coefficients_at(cost: CostModel, n: float) -> tuple[float, float, float]:
    """(α, β, γ) at concurrency n as ``ReplicaModel`` reads them: linear in c between levels, clipped."""
    levels = sorted(cost.levels)
    clipped = min(max(n, levels[0]), levels[-1])
    return tuple(float(np.interp(clipped, levels, [getattr(cost.levels[c], name) for c in levels]))
                 for name in ("alpha_ms_per_input_token", "beta_ms_per_output_token", "gamma_ms"))


def sim_latencies(chunks: np.ndarray, concurrency: np.ndarray, cost: CostModel, rows: np.ndarray,
                  tick_s: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(latency ms, weight, arrival tick) of the simulator's served requests: per chunk (arrival tick,
    served tick, count) and per request size, the whole-tick wait plus that size's latency at the
    serving tick's concurrency, weighted count × the size's share of ``rows``."""
    sizes = Counter(int(r) for r in rows)
    total = sum(sizes.values())
    latencies, weights, arrived = [], [], []
    for arrival, served_at, count in np.asarray(chunks).reshape(-1, 3):
        alpha, beta, gamma = coefficients_at(cost, float(concurrency[served_at]))
        wait_ms = (served_at - arrival) * tick_s * 1000.0
        for size, n in sizes.items():
            latencies.append(wait_ms + alpha * size + gamma)
            weights.append(count * n / total)
            arrived.append(arrival)
    return np.array(latencies), np.array(weights), np.array(arrived)


def percentiles(latencies_ms, weights=None) -> dict:
    """{"requests", "p50_ms", "p99_ms"}; requests = the summed weight; None for a figure with no request."""
    latencies_ms = np.asarray(latencies_ms, dtype=float)
    weights = np.ones(len(latencies_ms)) if weights is None else np.asarray(weights, dtype=float)
    if not weights.sum() > 0:
        return {"requests": 0, "p50_ms": None, "p99_ms": None}
    return {"requests": round(float(weights.sum()), 1),
            "p50_ms": round(weighted_percentile(latencies_ms, weights, 0.5), 1),
            "p99_ms": round(weighted_percentile(latencies_ms, weights, 0.99), 1)}


def step_series(changes: list[tuple[float, int]], ticks: int, initial: int = 0, tick_s: float = 1.0) -> np.ndarray:
    """A polled count, (seconds since start, count) in time order, read at the start of each tick:
    the last value seen at or before it (``initial`` before the first).

        >>> step_series([(0.1, 1), (2.5, 2), (2.9, 3)], 4).tolist()
        [0, 1, 1, 3]
    """
    out = np.full(ticks, initial, dtype=np.int64)
    at = np.array([t for t, _ in changes], dtype=float)
    values = np.array([v for _, v in changes], dtype=np.int64)
    for k in range(ticks):
        index = int(np.searchsorted(at, k * tick_s, side="right")) - 1
        if index >= 0:
            out[k] = values[index]
    return out


def count_difference(measured: np.ndarray, predicted: np.ndarray) -> dict:
    """Replica counts per tick compared: mean absolute and max difference, share of ticks equal,
    and replica-seconds of each (predicted − measured)."""
    measured, predicted = np.asarray(measured, dtype=float), np.asarray(predicted, dtype=float)
    if measured.shape != predicted.shape or not len(measured):
        raise ValueError(f"need two non-empty series of one length, got {measured.shape} and {predicted.shape}")
    diff = predicted - measured
    return {"mean_abs": round(float(np.abs(diff).mean()), 3), "max_abs": int(np.abs(diff).max()),
            "ticks_equal_share": round(float((diff == 0).mean()), 3),
            "replica_s_measured": float(measured.sum()), "replica_s_predicted": float(predicted.sum())}


def safe_ratio(predicted: float | None, measured: float | None) -> float:
    """predicted / measured; nan when either is missing or measured is not positive."""
    if predicted is None or measured is None or not measured > 0:
        return math.nan
    return predicted / measured


def phases(timing: Timing) -> dict[str, tuple[float, float]]:
    return {"before_step": (0, timing.step_at_s), "step": (timing.step_at_s, timing.step_end_s),
            "after_step": (timing.step_end_s, timing.duration_s)}


def compare(measured: dict, predicted: dict) -> dict:
    """The figures of both sides: whole-run and per-phase p50/p99 ratios, and replica-count differences.

    ``measured`` and ``predicted`` each hold ``latency`` ({"all": percentiles, phase: percentiles}),
    ``ready`` and ``total`` (per-tick replica counts: ready, and ready + starting)."""
    ratios = {}
    for name in measured["latency"]:
        m, p = measured["latency"][name], predicted["latency"][name]
        ratios[name] = {"p50": _rounded(safe_ratio(p["p50_ms"], m["p50_ms"])),
                        "p99": _rounded(safe_ratio(p["p99_ms"], m["p99_ms"]))}
    return {"latency_ratio_predicted_over_measured": ratios,
            "ready_replicas": count_difference(measured["ready"], predicted["ready"]),
            "replicas_ready_or_starting": count_difference(measured["total"], predicted["total"])}


def _rounded(value: float) -> float | None:
    return round(value, 3) if math.isfinite(value) else None


def verdict(comparison: dict) -> tuple[float, bool, str | None]:
    """(headline ratio, meets goal, why not).

    The headline is predicted p99 / measured p99 over all requests; the goal holds only when
    it, and the p99 ratio of every phase (before, during and after the step), lie within
    [GOAL_LOW, GOAL_HIGH], and the ready replicas differ by at most
    ``GOAL_REPLICAS_MEAN_ABS`` on average: every level measured counts.
    """
    ratios = comparison["latency_ratio_predicted_over_measured"]
    ratio = ratios["all"]["p99"]
    if ratio is None:
        return math.nan, False, "one side has no p99 (no request answered)"
    missed = [f"{name} p99 ratio {r['p99']}" for name, r in ratios.items()
              if r["p99"] is None or not GOAL_LOW <= r["p99"] <= GOAL_HIGH]
    replicas = comparison["ready_replicas"]["mean_abs"]
    if replicas > GOAL_REPLICAS_MEAN_ABS:
        missed.append(f"ready replicas differ by {replicas} on average (> {GOAL_REPLICAS_MEAN_ABS})")
    if not missed:
        return ratio, True, None
    return ratio, False, f"outside [{GOAL_LOW}, {GOAL_HIGH}]: " + "; ".join(missed)
