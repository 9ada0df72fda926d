"""A simulated day: every policy against the same demand, replica model and cold starts.

    settings = DaySettings(peak_rps=200_000, cold_start="plain")
    result = run_day(read_trace(TRACE), settings)      # {"rows": [...], "runs": [...], ...}

Every policy starts at the replicas the first minute needs at the target concurrency and is
bounded by ``[min_replicas, max_replicas]``. The per-replica target of every reactive policy
is the cost model's target concurrency (the same operating point), except where a system's
default says otherwise (Knative's and AIBrix's 70 % target utilization, Ray Serve's literal
default of 2 ongoing requests in its own row). Static peak holds the replicas the day's
busiest second needs at that target; the oracle is ``autoscale.sim.oracle``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autoscale.sim import anchors
from autoscale.sim.demand import Demand, Trace, diurnal_day
from autoscale.sim.fleet import FleetConfig, FleetRun, replicas_for_rate, simulate
from autoscale.sim.modelplane import ModelplanePolicy
from autoscale.sim.names import POLICIES
from autoscale.sim.oracle import Oracle
from autoscale.sim.replica import COLD_STARTS, ColdStart, ReplicaModel, h100_small
from autoscale.sim.report import figures
from autoscale.sim.view import ScalingPolicy
from costmodel.fit import CostModel

YESTERDAY_SEED_OFFSET = 1_000
DAY_MINUTES = 1_440


@dataclass(frozen=True)
class DaySettings:
    peak_rps: float = 200_000.0
    seed: int = 0
    cold_start: str = "plain"
    slo_attainment: float = 0.9999
    min_replicas: int = 1
    max_replicas: int = 400
    policies: tuple[str, ...] = POLICIES
    duration_s: int = 86_400
    target_concurrency: float | None = None  # the spec's scaling.target_concurrency: pinned (no vertical axis)
    scale_to_zero_grace_s: float = 300.0
    measured_cold_start_s: float | None = None  # cold_start "measured": a revision's own, median (p90 = 1.5 ×)

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise ValueError(f"unknown polic{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; known: "
                             f"{', '.join(POLICIES)}")
        if self.cold_start == "measured" and not (self.measured_cold_start_s or 0) > 0:
            raise ValueError("cold start 'measured' needs the measured cold start (modelplane simulate --endpoint "
                             "reads it from the serving revision; it has none until its first replica was ready)")
        if self.cold_start not in COLD_STARTS and self.cold_start != "measured":
            raise ValueError(f"unknown cold start kind {self.cold_start!r}; known: {', '.join(COLD_STARTS)}, "
                             f"measured (with --endpoint)")
        if not 1 <= self.max_replicas or not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 ≤ min_replicas ≤ max_replicas and max_replicas ≥ 1, got {self.min_replicas} "
                             f"and {self.max_replicas}")
        if not 0 < self.slo_attainment < 1:
            raise ValueError(f"slo_attainment must be in (0, 1), got {self.slo_attainment}")


def cold_start_of(settings: DaySettings) -> ColdStart:
    """The kind's assumed distribution, or a revision's measured cold start as the median (p90 = 1.5 ×)."""
    if settings.cold_start == "measured":
        return ColdStart("measured", settings.measured_cold_start_s, 1.5 * settings.measured_cold_start_s)
    return COLD_STARTS[settings.cold_start]


def yesterday_in_flight(demand: Demand, model: ReplicaModel) -> dict[int, float]:
    """Yesterday's peak in flight per minute, keyed as the controller stores it: minute m of the
    demand (its start is today's 00:00) is m − 1440.

    In flight by Little's law at the target concurrency: arrivals a second × the latency there.
    """
    latency_s = model.latency_ms(model.target_concurrency) / 1000.0
    per_tick = round(60 / demand.tick_s)
    minutes = demand.ticks // per_tick
    peaks = demand.arrivals[:minutes * per_tick].reshape(minutes, per_tick).max(axis=1) / demand.tick_s * latency_s
    return {m - DAY_MINUTES: float(v) for m, v in enumerate(peaks)}


def build_policy(name: str, demand: Demand, model: ReplicaModel, settings: DaySettings,
                 yesterday: Callable[[], dict[int, float]]) -> tuple[ScalingPolicy, int]:
    """The policy named ``name`` and the replicas the fleet starts with under it."""
    target = settings.target_concurrency or model.target_concurrency
    rps_at_target = model.throughput_rps(target)
    clamp = lambda n: min(max(n, settings.min_replicas, 1), settings.max_replicas)  # noqa: E731
    initial = clamp(replicas_for_rate(float(demand.arrivals[:60].mean()) / demand.tick_s, rps_at_target))
    bounds = {"min_replicas": settings.min_replicas, "max_replicas": settings.max_replicas,
              "initial_replicas": initial}
    cold = cold_start_of(settings)
    if name == "static_peak":
        peak = clamp(replicas_for_rate(demand.peak_rps, rps_at_target))
        return anchors.StaticPeak(peak), peak
    if name == "oracle":
        _, rps_at_slo = model.capacity_at_slo(settings.slo_attainment)
        oracle = Oracle(demand.arrivals, demand.tick_s, rps_at_slo, cold.quantile_s(0.99), settings.min_replicas,
                        settings.max_replicas)
        return oracle, int(oracle.plan[0])
    if name.startswith("modelplane_"):
        return ModelplanePolicy(name.removeprefix("modelplane_"), target_concurrency=target,
                                sweep_concurrency=sorted(model.cost.levels), slo_p99_ms=model.slo_ms,
                                target_pinned=settings.target_concurrency is not None,
                                scale_to_zero_grace_s=settings.scale_to_zero_grace_s,
                                cold_start_s=cold.quantile_s(0.9),
                                yesterday=yesterday() if name.endswith("predictive") else None,
                                **bounds), initial
    if name == "ray_serve_target_2":
        policy = anchors.RayServe(target_per_replica=2.0, **bounds)
        policy.name = name
        return policy, initial
    factory = {"hpa": anchors.KubernetesHPA, "knative_kpa": anchors.KnativeKPA, "ray_serve": anchors.RayServe,
               "aibrix_kpa": anchors.AIBrixKPA}[name]
    return factory(target_per_replica=target, **bounds), initial


def run_policy(name: str, demand: Demand, model: ReplicaModel, settings: DaySettings,
               yesterday: Callable[[], dict[int, float]]) -> FleetRun:
    policy, initial = build_policy(name, demand, model, settings, yesterday)
    config = FleetConfig(initial_replicas=initial, cold_start=cold_start_of(settings), seed=settings.seed)
    return simulate(demand, model, policy, config)


def run_day(trace: Trace, settings: DaySettings = DaySettings(), cost: CostModel | None = None,
            log: Callable[[str], None] = lambda line: None) -> dict:
    """The synthetic day (``diurnal_day``), with yesterday drawn the same way from another seed."""
    demand = diurnal_day(trace, settings.peak_rps, settings.seed, duration_s=settings.duration_s)

    def yesterday() -> Demand:
        return diurnal_day(trace, settings.peak_rps, settings.seed + YESTERDAY_SEED_OFFSET,
                           duration_s=settings.duration_s)

    return run_demand(demand, yesterday, cost or h100_small(trace.input_tokens, trace.output_tokens), settings, log)


def run_demand(demand: Demand, yesterday_demand: Callable[[], Demand], cost: CostModel, settings: DaySettings,
               log: Callable[[str], None] = lambda line: None) -> dict:
    """Every policy of ``settings`` against ``demand``: the rows, the runs, and what was assumed.

    ``yesterday_demand`` is called only when the predictive floor needs the day before.
    """
    model = ReplicaModel(cost, demand.input_tokens, demand.output_tokens)
    cache: dict[str, dict[int, float]] = {}

    def yesterday() -> dict[int, float]:
        if "day" not in cache:
            cache["day"] = yesterday_in_flight(yesterday_demand(), model)
        return cache["day"]

    runs = {}
    for name in settings.policies:
        log(f"simulating {name} …")
        runs[name] = run_policy(name, demand, model, settings, yesterday)
    static_hours = runs["static_peak"].replica_seconds / 3600 if "static_peak" in runs else None
    oracle_hours = runs["oracle"].replica_seconds / 3600 if "oracle" in runs else None
    rps_at_target = model.throughput_rps(settings.target_concurrency or model.target_concurrency)
    rows = [figures(run, static_replica_hours=static_hours, oracle_replica_hours=oracle_hours) for run in runs.values()]
    slo_concurrency, slo_rps = model.capacity_at_slo(settings.slo_attainment)
    cold = cold_start_of(settings)
    assumptions = {
        "demand": demand.description, "peak_rps": demand.peak_rps, "mean_rps": round(demand.mean_rps, 1),
        "cost_model": cost.slo_message,
        "target_concurrency": settings.target_concurrency or model.target_concurrency,
        "target_pinned": settings.target_concurrency is not None,
        "replicas": [settings.min_replicas, settings.max_replicas],
        "rps_per_replica_at_target": round(rps_at_target, 1), "slo_ms": model.slo_ms,
        "slo_attainment": settings.slo_attainment, "oracle_concurrency": round(slo_concurrency, 1),
        "oracle_rps_per_replica": round(slo_rps, 1), "max_batch": model.max_batch,
        "cold_start": {"kind": cold.kind, "median_s": cold.median_s, "p90_s": cold.p90_s},
        "max_queue_wait_s": 10.0, "seed": settings.seed,
    }
    return {"rows": rows, "runs": list(runs.values()), "assumptions": assumptions,
            "bound_saving_vs_static": round(1 - demand.mean_rps / demand.peak_rps, 4)}

