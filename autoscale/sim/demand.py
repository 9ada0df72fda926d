"""Demand for the day model: arrivals per 1 s tick, and the request sizes they draw from.

Two sources, both held as a :class:`Demand` (one integer arrival count per tick plus a pool
of request sizes):

- :func:`diurnal_day`: a synthetic day shaped like an interactive LLM service. A night
  trough, a **10× ramp within one minute** when the working day starts (the seeds' 10 to
  10,000 QPS in 60 s, at fleet scale), a daytime rise to a peak event at ``peak_rps``
  (200K QPS by default), an evening fall, and short bursts at random times. Minute-to-minute
  fluctuation comes from the real Azure LLM trace: its per-minute arrival counts, divided by
  their mean, multiply the envelope (the hour of the trace repeats with a random offset per
  hour). Counts per tick are Poisson draws around that rate. Request sizes are the trace's
  (input, output) token pairs.
- :func:`replay`: a user's own trace (``modelplane simulate --trace FILE``), its arrivals
  counted per second, and, with ``rate_scale`` k, as if k shifted copies of it were
  superposed (counts × k, rounded by a Poisson draw), so a one-machine trace can stand for a
  fleet's.

A trace is a CSV with the Azure trace's columns ``TIMESTAMP,ContextTokens,GeneratedTokens``
(``read_trace``). Everything here is deterministic for a given seed.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# The Azure conversation trace sits beside the checkout (../shared/data); MODELPLANE_TRACE_CSV points elsewhere.
DEFAULT_TRACE = Path(os.environ.get("MODELPLANE_TRACE_CSV", Path(__file__).resolve().parents[3] / "shared" / "data"
                                    / "azure-llm-trace-2023" / "AzureLLMInferenceTrace_conv.csv"))
DAY_S = 86_400
HOUR_S = 3_600


class TraceError(ValueError):
    """A trace file that cannot be used, with what to fix."""


@dataclass(frozen=True)
class Trace:
    """One row per request: arrival (seconds after the first), input and output tokens."""

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    source: str

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self.arrival_s) else 0.0


def _timestamp_s(text: str, path: Path, line: int) -> float:
    value = text.strip()
    try:
        return float(value)  # seconds, as some exports write them
    except ValueError:
        pass
    if "." in value:  # the Azure trace has 7 fractional digits; datetime takes at most 6
        head, fraction = value.split(".", 1)
        value = f"{head}.{fraction[:6]}"
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise TraceError(f"{path}:{line}: TIMESTAMP {text!r} is neither seconds nor an ISO date-time "
                         f"like 2023-11-16 18:15:46.680590") from None


def read_trace(path: str | Path) -> Trace:
    """Read a trace CSV with columns TIMESTAMP, ContextTokens, GeneratedTokens (any order, extra columns ignored).

    Rows are sorted by arrival. A generated count of 0 counts as 1 token (the request still
    ran a decode step). Raises TraceError naming the file, line and column of the first problem.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist")
    arrivals, inputs, outputs = [], [], []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)}; a trace needs the columns "
                             f"{','.join(TRACE_COLUMNS)} (the Azure LLM inference trace's)")
        for line, row in enumerate(reader, start=2):
            try:
                i, o = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError):
                raise TraceError(f"{path}:{line}: ContextTokens and GeneratedTokens must be whole numbers, got "
                                 f"{row['ContextTokens']!r} and {row['GeneratedTokens']!r}") from None
            if i < 0 or o < 0:
                raise TraceError(f"{path}:{line}: token counts cannot be negative ({i}, {o})")
            arrivals.append(_timestamp_s(row["TIMESTAMP"], path, line))
            inputs.append(i)
            outputs.append(max(o, 1))
    if not arrivals:
        raise TraceError(f"{path}: no requests (the file holds only its header)")
    order = np.argsort(np.array(arrivals), kind="stable")
    arrival = np.array(arrivals)[order]
    return Trace(arrival - arrival[0], np.array(inputs, dtype=np.int64)[order],
                 np.array(outputs, dtype=np.int64)[order], str(path))


@dataclass(frozen=True)
class Demand:
    """Arrivals per tick (``tick_s`` = 1 s) and the pool of request sizes they draw from.

    ``ramp_at_s`` is where the 10× ramp starts (None: no ramp), for the time to capacity.
    ``description`` says how the demand was made (the transformation applied to the trace).
    """

    arrivals: np.ndarray  # int64 per tick
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    description: str
    ramp_at_s: float | None = None
    tick_s: float = 1.0

    @property
    def ticks(self) -> int:
        return len(self.arrivals)

    @property
    def peak_rps(self) -> float:
        return float(self.arrivals.max()) / self.tick_s if self.ticks else 0.0

    @property
    def mean_rps(self) -> float:
        return float(self.arrivals.mean()) / self.tick_s if self.ticks else 0.0


@dataclass(frozen=True)
class DayShape:
    """The synthetic day's envelope, as fractions of ``peak_rps`` at hours of the day.

    Night ``night`` (at 05:00 its lowest, ``night_low``); at ``ramp_hour`` the rate jumps
    ``ramp_factor``× within ``ramp_s``; the day rises to ``day_high`` at ``day_peak_hour``
    and falls to ``evening`` by 21:00; a peak event of ``event_minutes`` around
    ``day_peak_hour`` reaches 1.0 (the peak). ``bursts`` short bursts (``burst_s`` long,
    ×``burst_factor``) fall at uniform random times.
    """

    night: float = 0.03
    night_low: float = 0.02
    ramp_hour: float = 9.0
    ramp_factor: float = 10.0
    ramp_s: float = 60.0
    day_high: float = 0.4
    day_peak_hour: float = 14.0
    evening: float = 0.08
    event_minutes: float = 30.0
    bursts: int = 24
    burst_s: tuple[float, float] = (10.0, 120.0)
    burst_factor: tuple[float, float] = (1.3, 2.0)


def _smooth(x: np.ndarray, start: float, end: float, low: float, high: float) -> np.ndarray:
    """A half-cosine from ``low`` at ``start`` to ``high`` at ``end`` (constant outside)."""
    t = np.clip((x - start) / (end - start), 0.0, 1.0)
    return low + (high - low) * (1 - np.cos(math.pi * t)) / 2


def envelope(shape: DayShape, duration_s: int = DAY_S) -> np.ndarray:
    """The day's rate per second as a fraction of the peak, before bursts and trace fluctuation.

        >>> e = envelope(DayShape())
        >>> round(float(e[int(8.99 * 3600)]), 3), round(float(e[int(9 * 3600) + 60]), 3), float(e.max())
        (0.025, 0.25, 1.0)
    """
    hours = np.arange(duration_s) / HOUR_S
    ramp_end_h = shape.ramp_hour + shape.ramp_s / HOUR_S
    before_ramp = np.where(hours < 5.0, _smooth(hours, 0.0, 5.0, shape.night, shape.night_low),
                           _smooth(hours, 5.0, shape.ramp_hour, shape.night_low, shape.night * 5 / 6))
    at_ramp = before_ramp[min(int(shape.ramp_hour * HOUR_S), duration_s - 1)] if duration_s else 0.0
    ramp_top = at_ramp * shape.ramp_factor
    during = _smooth(hours, shape.ramp_hour, ramp_end_h, at_ramp, ramp_top)
    day = np.where(hours < shape.day_peak_hour, _smooth(hours, ramp_end_h, shape.day_peak_hour, ramp_top,
                                                        shape.day_high),
                   _smooth(hours, shape.day_peak_hour, 21.0, shape.day_high, shape.evening))
    late = _smooth(hours, 21.0, 24.0, shape.evening, shape.night)
    rate = np.where(hours < shape.ramp_hour, before_ramp, np.where(hours < ramp_end_h, during,
                                                                    np.where(hours < 21.0, day, late)))
    half_event_h = shape.event_minutes / 60 / 2
    rise = _smooth(hours, shape.day_peak_hour - half_event_h, shape.day_peak_hour, 0.0, 1.0)
    fall = _smooth(hours, shape.day_peak_hour, shape.day_peak_hour + half_event_h, 1.0, 0.0)
    event = np.where(hours < shape.day_peak_hour, rise, fall)
    return np.maximum(rate, event)


def minute_fluctuation(trace: Trace) -> np.ndarray:
    """The trace's arrivals per minute divided by their mean: its real minute-to-minute burstiness.

    Whole minutes only (a partial last minute would read as a dip).
    """
    minutes = int(trace.duration_s // 60)
    if minutes < 2:
        raise TraceError(f"{trace.source}: spans {trace.duration_s:.0f} s; the day model needs at least two "
                         f"whole minutes of arrivals to take its fluctuation from")
    counts = np.bincount((trace.arrival_s // 60).astype(np.int64), minlength=minutes)[:minutes].astype(float)
    return counts / counts.mean()


def diurnal_day(trace: Trace, peak_rps: float = 200_000.0, seed: int = 0, shape: DayShape = DayShape(),
                duration_s: int = DAY_S) -> Demand:
    """A day of arrivals peaking near ``peak_rps``; sizes from ``trace``. See the module docstring."""
    if peak_rps <= 0:
        raise ValueError(f"peak_rps must be > 0, got {peak_rps}")
    rng = np.random.default_rng(seed)
    rate = envelope(shape, duration_s)
    fluctuation = minute_fluctuation(trace)
    seconds = np.arange(duration_s)
    hour_offsets = rng.integers(0, len(fluctuation), size=duration_s // HOUR_S + 1)
    minute_index = (seconds // 60 + hour_offsets[seconds // HOUR_S]) % len(fluctuation)
    # Interpolate between minutes so the factor has no one-second steps.
    following = (minute_index + 1) % len(fluctuation)
    within = (seconds % 60) / 60.0
    factor = fluctuation[minute_index] * (1 - within) + fluctuation[following] * within
    rate = rate * factor / factor.max() * (factor.max() / np.percentile(factor, 99))  # the trace's p99 minute → 1
    for _ in range(shape.bursts):
        start = rng.uniform(0, duration_s)
        length = rng.uniform(*shape.burst_s)
        height = rng.uniform(*shape.burst_factor)
        inside = (seconds >= start) & (seconds < start + length)
        rate[inside] *= height
    rate = rate / rate.max() * peak_rps
    arrivals = rng.poisson(rate).astype(np.int64)
    ramp_at = shape.ramp_hour * HOUR_S if shape.ramp_factor > 1 and shape.ramp_hour * HOUR_S < duration_s else None
    span = "day" if duration_s >= DAY_S else f"first {duration_s / HOUR_S:g} h of a day"
    ramp = f"{shape.ramp_factor:g}× ramp within {shape.ramp_s:g} s at {shape.ramp_hour:g}:00, " if ramp_at else ""
    description = (f"synthetic {span}, scaled so its busiest second is {peak_rps:,.0f} req/s: night trough, {ramp}"
                   f"peak event at {shape.day_peak_hour:g}:00, {shape.bursts} bursts "
                   f"×{shape.burst_factor[0]:g}–{shape.burst_factor[1]:g}; minute-to-minute fluctuation from "
                   f"{Path(trace.source).name} (its per-minute counts / mean, a random offset per hour); Poisson "
                   f"counts per second (seed {seed}); sizes drawn from the trace's {len(trace.input_tokens):,} requests")
    return Demand(arrivals, trace.input_tokens, trace.output_tokens, description, ramp_at)


def replay(trace: Trace, rate_scale: float = 1.0, seed: int = 0) -> Demand:
    """The trace's own arrivals per second, × ``rate_scale`` (as that many superposed shifted copies)."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    ticks = int(math.floor(trace.duration_s)) + 1
    counts = np.bincount(np.floor(trace.arrival_s).astype(np.int64), minlength=ticks)[:ticks]
    if rate_scale == 1.0:
        arrivals = counts.astype(np.int64)
        how = "replayed as recorded"
    else:
        arrivals = np.random.default_rng(seed).poisson(counts * rate_scale).astype(np.int64)
        how = f"× {rate_scale:g} (as {rate_scale:g} superposed shifted copies; Poisson counts, seed {seed})"
    return Demand(arrivals, trace.input_tokens, trace.output_tokens,
                  f"{Path(trace.source).name}: {len(trace.arrival_s):,} requests over {trace.duration_s:.0f} s, "
                  f"arrivals per second {how}")
