"""The predictive floor: raise the minimum ahead of a ramp the endpoint had yesterday.

A reactive policy starts replicas only once demand arrives, so a daily ramp steeper than
cold start outruns it. The floor looks one cold start ahead (``horizon_s``, the endpoint's
measured cold start) in yesterday's demand:

    forecast = max(peak in [now - 1 day, now - 1 day + horizon],
                   peak in [now - 7 days, now - 7 days + horizon])   # the week only if held
               × clamp(mean of the last 10 minutes / mean of the same 10 minutes a day ago, 0.5, 2)

and the floor is ``ceil(forecast / target)``, capped at ``max_replicas``. The ratio carries
today's level (a busier day than yesterday) while the seasonal peak carries the shape. The
floor only ever raises a reactive decision (``apply_floor``); it never lowers one.

Worked example: a day ago the next 2 minutes peaked at 40 in flight, and the last 10 minutes
ran at 12 against 10 the same minutes a day ago: 40 × 1.2 = 48, target 4 → 12 replicas.

``DemandHistory`` keeps the peak in flight of each minute for 8 days (a week and a day, so
the week-ago window is there). ``now_s`` and each sample's ``at_s`` must come from one clock;
a history that outlives the controller process wants wall-clock seconds.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from autoscale.horizontal import Decision, replicas_for

MINUTE_S = 60.0
DAY_S = 86_400.0
WEEK_S = 7 * DAY_S
RETENTION_S = 8 * DAY_S
RECENT_S = 600.0  # the last 10 minutes set today's level against yesterday's
RATIO_MIN, RATIO_MAX = 0.5, 2.0


def _minute(at_s: float) -> int:
    return math.floor(at_s / MINUTE_S)


@dataclass
class DemandHistory:
    """Peak in-flight demand per minute (minute index = floor(at_s / 60)), the last ``retention_s``.

    Mutable on purpose: ``add`` is called about once a second, and copying 8 days of minutes
    each time would cost more than the policy itself. Its only state is ``peak_by_minute``.

        >>> history = DemandHistory()
        >>> for at_s, in_flight in ((0.0, 3.0), (30.0, 5.0), (61.0, 2.0)):
        ...     history.add(at_s, in_flight)
        >>> dict(history.peak_by_minute)
        {0: 5.0, 1: 2.0}
    """

    peak_by_minute: OrderedDict[int, float] = field(default_factory=OrderedDict)
    retention_s: float = RETENTION_S

    def add(self, at_s: float, in_flight: float) -> None:
        """Record one sample. Late samples for a minute no longer held are dropped (samples arrive in order)."""
        minute = _minute(at_s)
        previous = self.peak_by_minute.get(minute)
        if previous is not None:
            self.peak_by_minute[minute] = max(previous, in_flight)
            return
        if self.peak_by_minute and minute < next(reversed(self.peak_by_minute)):
            return
        self.peak_by_minute[minute] = in_flight
        oldest_kept = minute - math.ceil(self.retention_s / MINUTE_S)
        while next(iter(self.peak_by_minute)) < oldest_kept:
            self.peak_by_minute.popitem(last=False)

    def peaks(self, first_minute: int, last_minute: int) -> list[float]:
        """The held peaks of minutes ``first_minute..last_minute`` inclusive (missing minutes skipped)."""
        found = (self.peak_by_minute.get(m) for m in range(first_minute, last_minute + 1))
        return [peak for peak in found if peak is not None]


@dataclass(frozen=True)
class Forecast:
    """The peak expected within the horizon, and how it was reached."""

    peak: float
    seasonal_peak: float
    seasonal_source: str  # "a day ago" or "a week ago", whichever window peaked higher
    ratio: float  # today's level against yesterday's, clamped to [0.5, 2]


def _window_peak(history: DemandHistory, start_s: float, horizon_s: float) -> float | None:
    peaks = history.peaks(_minute(start_s), _minute(start_s + horizon_s))
    return max(peaks) if peaks else None


def _level_ratio(history: DemandHistory, now_s: float) -> float:
    """mean(last 10 full minutes) / mean(the same minutes a day ago), clamped; 1 without evidence."""
    this_minute, span = _minute(now_s), round(RECENT_S / MINUTE_S)
    day_minutes = round(DAY_S / MINUTE_S)
    recent = history.peaks(this_minute - span, this_minute - 1)
    before = history.peaks(this_minute - day_minutes - span, this_minute - day_minutes - 1)
    if not recent or not before:
        return 1.0
    recent_mean, before_mean = sum(recent) / len(recent), sum(before) / len(before)
    if before_mean <= 0:
        return RATIO_MAX if recent_mean > 0 else 1.0
    return min(max(recent_mean / before_mean, RATIO_MIN), RATIO_MAX)


def forecast(history: DemandHistory, now_s: float, horizon_s: float) -> Forecast | None:
    """The forecast with its parts; None when no demand from a day ago is held for the window."""
    day_peak = _window_peak(history, now_s - DAY_S, horizon_s)
    if day_peak is None:
        return None
    week_peak = _window_peak(history, now_s - WEEK_S, horizon_s)
    seasonal, source = (week_peak, "a week ago") if week_peak is not None and week_peak > day_peak \
        else (day_peak, "a day ago")
    ratio = _level_ratio(history, now_s)
    return Forecast(seasonal * ratio, seasonal, source, ratio)


def forecast_peak(history: DemandHistory, now_s: float, horizon_s: float) -> float | None:
    """Peak in flight expected within ``horizon_s`` (see the module docstring); None without day-old history.

        >>> history = DemandHistory()
        >>> for minute in range(1440 + 2):  # a flat 10 in flight for a day, then 12 now
        ...     history.add(minute * 60.0, 40.0 if minute == 12 else 10.0)
        >>> for minute in range(1440 + 2, 1440 + 12):
        ...     history.add(minute * 60.0, 12.0)
        >>> round(forecast_peak(history, now_s=(1440 + 12) * 60.0, horizon_s=60.0), 2)
        48.0
        >>> forecast_peak(DemandHistory(), now_s=0.0, horizon_s=60.0) is None
        True
    """
    result = forecast(history, now_s, horizon_s)
    return None if result is None else result.peak


def predictive_floor(history: DemandHistory, now_s: float, horizon_s: float, target: float,
                     max_replicas: int) -> tuple[int, str]:
    """``(min(ceil(forecast / target), max_replicas), reason)``; 0 when there is no day-old history.

    Forecast 48 in flight at target 4: 12 replicas (with max_replicas 10: 10).
    """
    result = forecast(history, now_s, horizon_s)
    if result is None:
        return 0, "no demand history from a day ago: no predictive floor"
    want = replicas_for(result.peak, target)
    floor = min(want, max_replicas)
    capped = f", capped at max_replicas {max_replicas}" if want > max_replicas else ""
    return floor, (f"{result.seasonal_source} the next {horizon_s:.0f} s peaked at {result.seasonal_peak:.1f} in "
                   f"flight and the last 10 min ran {result.ratio:.2f}× the same minutes a day ago: forecast "
                   f"{result.peak:.1f} / target {target:g} = {want} replicas{capped}")


def apply_floor(decision: Decision, floor: int, reason: str) -> Decision:
    """``max(decision.replicas, floor)``: the floor raises a reactive decision, never lowers it.

    When the floor wins, the rule becomes ``predictive-floor`` and the reason keeps the
    reactive one. The controller then records the applied count as the policy's desired
    (``dataclasses.replace(state, desired=decision.replicas)``), so that leaving the floor
    later goes through the scale-down rules (lookback, loading, history) like any reduction.

        >>> reactive = Decision(3, "hold", "holding 3 replicas", {})
        >>> floored = apply_floor(reactive, 12, "forecast 48.0 / target 4 = 12 replicas")
        >>> floored.replicas, floored.rule, apply_floor(reactive, 2, "forecast 6.0").replicas
        (12, 'predictive-floor', 3)
    """
    inputs = {**decision.inputs, "predictive_floor": floor}
    if floor <= decision.replicas:
        return replace(decision, inputs=inputs)
    return Decision(floor, "predictive-floor", f"{reason} (the reactive policy wanted {decision.replicas}: "
                    f"{decision.reason})", {**inputs, "reactive_replicas": decision.replicas,
                                            "reactive_rule": decision.rule})
