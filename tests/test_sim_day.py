"""The day model (autoscale.sim): every request counted once, deterministic, the real controller inside,
and on a constant demand each policy settles where its own formula says."""

from dataclasses import replace

import numpy as np
import pytest

import autoscale.controller.loop
import autoscale.horizontal
from autoscale.sim import anchors
from autoscale.sim.day import POLICIES, DaySettings, build_policy, run_demand
from autoscale.sim.demand import Demand, Trace, TraceError, diurnal_day, read_trace, replay
from autoscale.sim.fleet import FleetConfig, simulate
from autoscale.sim.modelplane import ModelplanePolicy
from autoscale.sim.replica import COLD_STARTS, ColdStart, ReplicaModel, h100_small
from costmodel.fit import Coefficients, CostModel

RATE_RPS = 10_000
LATENCY_MS = 50.0  # the same at every concurrency: in flight = rate × latency exactly (Little)


def constant_latency_cost() -> CostModel:
    levels = {c: Coefficients(0.0, 0.0, LATENCY_MS, c) for c in (1, 64, 128)}
    return CostModel(levels=levels, target_concurrency=64, slo_met=True, slo_message="test", r2=1.0,
                     heldout_median_abs_pct_error=0.0, n_samples=0, kind="classic", slo_p99_ms=200.0)


def constant_demand(ticks: int, rate: int = RATE_RPS) -> Demand:
    sizes = np.ones(10, dtype=np.int64)
    return Demand(np.full(ticks, rate, dtype=np.int64), sizes, sizes, "constant")


def small_trace(seed: int = 0, requests: int = 600) -> Trace:
    rng = np.random.default_rng(seed)
    return Trace(np.sort(rng.uniform(0, 600, requests)), rng.integers(10, 4000, requests),
                 rng.integers(1, 600, requests), "synthetic.csv")


def settle(name: str, ticks: int = 1_500) -> int:
    """The count a policy orders at the end of a constant demand (warm pool cold starts)."""
    demand = constant_demand(ticks)
    settings = DaySettings(cold_start="warm_pool", max_replicas=400, duration_s=ticks)
    model = ReplicaModel(constant_latency_cost(), demand.input_tokens, demand.output_tokens)
    policy, _ = build_policy(name, demand, model, settings, yesterday=lambda: {})
    run = simulate(demand, model, policy, FleetConfig(initial_replicas=1, cold_start=COLD_STARTS["warm_pool"]))
    return int(run.desired[-1])


@pytest.mark.parametrize("name, expected", [
    ("modelplane_horizontal", 8),  # in flight 10,000 req/s × 0.05 s = 500; ceil(500 / 64) = 8
    # p99 50 ms < 0.7 × 200 ms with replicas near their target: the vertical axis raises the target 10 % a
    # cycle up to the largest swept level, 128; ceil(500 / 128) = 4
    ("modelplane_two_axes", 4),
    ("hpa", 8),  # ceil(500 / 64) = 8; at 8 the ratio 500 / 8 / 64 = 0.98 is within the 0.1 tolerance
    ("knative_kpa", 12),  # ceil(500 / (0.7 × 64)) = ceil(11.16) = 12
    ("ray_serve", 8),  # ceil(500 / 64) = 8
    ("static_peak", 8),  # 10,000 / (64 / 0.05 s = 1,280 req/s) = 7.8 → 8
    ("oracle", 4),  # every request meets the 200 ms SLO even at 128 in flight: 10,000 / 2,560 → 4
])
def test_a_constant_demand_settles_where_each_policys_formula_says(name, expected):
    assert settle(name) == expected


def test_every_request_is_served_rejected_or_still_queued_exactly_once_under_every_policy():
    trace = small_trace()
    settings = DaySettings(peak_rps=20_000, duration_s=3_600, cold_start="plain", max_replicas=40)
    demand = diurnal_day(trace, settings.peak_rps, seed=3, duration_s=settings.duration_s)
    yesterday = diurnal_day(trace, settings.peak_rps, seed=4, duration_s=settings.duration_s)
    result = run_demand(demand, lambda: yesterday, h100_small(trace.input_tokens, trace.output_tokens), settings)
    assert [row["policy"] for row in result["rows"]] == list(POLICIES)
    for row in result["rows"]:
        assert row["conservation_error"] == 0, row["policy"]
        assert row["requests"] == int(demand.arrivals.sum())
    assert sum(row["rejected"] for row in result["rows"]) > 0  # the cap of 40 replicas bites: rejections counted


def test_the_same_seed_gives_the_same_day_and_another_seed_another():
    trace = small_trace()
    settings = DaySettings(peak_rps=5_000, duration_s=1_800, policies=("modelplane_two_axes", "hpa"))

    def rows(seed):
        demand = diurnal_day(trace, settings.peak_rps, seed=seed, duration_s=settings.duration_s)
        return run_demand(demand, lambda: demand, h100_small(trace.input_tokens, trace.output_tokens),
                          settings)["rows"]

    assert rows(1) == rows(1)
    assert rows(1) != rows(2)


def test_modelplane_in_the_simulator_is_the_controller_itself_not_a_copy():
    policy = ModelplanePolicy("two_axes", target_concurrency=64, sweep_concurrency=[1, 64, 128], slo_p99_ms=150,
                              min_replicas=1, max_replicas=10, initial_replicas=1)
    assert type(policy.controller) is autoscale.controller.loop.Controller
    assert autoscale.controller.loop.decide is autoscale.horizontal.decide


def test_the_predictive_floor_orders_ahead_of_yesterdays_ramp():
    """Yesterday 2,000 in flight from minute 30; today the same ramp: the floor has replicas ordered before it."""
    ticks = 3_600
    arrivals = np.where(np.arange(ticks) < 1_800, 1_000, 40_000).astype(np.int64)
    demand = Demand(arrivals, np.ones(10, dtype=np.int64), np.ones(10, dtype=np.int64), "step")
    model = ReplicaModel(constant_latency_cost(), demand.input_tokens, demand.output_tokens)
    yesterday = {m - 1440: (50.0 if m < 30 else 2_000.0) for m in range(60)}  # in flight = rate × 0.05 s
    cold = ColdStart("slow", 120.0, 150.0)
    ordered = {}
    for mode in ("horizontal", "two_axes_predictive"):
        policy = ModelplanePolicy(mode, target_concurrency=64, sweep_concurrency=[1, 64, 128], slo_p99_ms=200,
                                  min_replicas=1, max_replicas=100, initial_replicas=1, cold_start_s=150.0,
                                  yesterday=yesterday)
        run = simulate(demand, model, policy, FleetConfig(initial_replicas=1, cold_start=cold))
        ordered[mode] = int(run.desired[1_790])
    assert ordered["horizontal"] == 1  # 50 in flight: one replica until the ramp arrives
    assert ordered["two_axes_predictive"] >= 2_000 // 64  # ceil(2,000 / 64) = 32 ordered before minute 30


def test_a_trace_without_the_azure_columns_is_refused_naming_them(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt\n1,2\n")
    with pytest.raises(TraceError, match="missing column.*ContextTokens.*GeneratedTokens"):
        read_trace(bad)
    worse = tmp_path / "worse.csv"
    worse.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,12,x\n")
    with pytest.raises(TraceError, match="worse.csv:2"):
        read_trace(worse)


def test_a_replayed_trace_keeps_its_arrivals_per_second_and_scales_by_superposition(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.2,10,0\n0.7,20,5\n2.5,30,5\n")
    trace = read_trace(path)
    assert trace.output_tokens.tolist() == [1, 5, 5]  # 0 generated tokens count as 1
    assert replay(trace).arrivals.tolist() == [2, 0, 1]
    assert replay(trace, rate_scale=100.0, seed=1).arrivals.sum() == pytest.approx(300, rel=0.2)


def test_unknown_policies_and_cold_starts_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown policy hpx; known: static_peak"):
        DaySettings(policies=("hpx",))
    with pytest.raises(ValueError, match="known: plain, lazy_image, warm_pool"):
        DaySettings(cold_start="instant")


def test_anchors_module_is_what_the_day_builds_from():
    demand = constant_demand(10)
    model = ReplicaModel(constant_latency_cost(), demand.input_tokens, demand.output_tokens)
    policy, _ = build_policy("hpa", demand, model, DaySettings(duration_s=10), yesterday=lambda: {})
    assert type(policy) is anchors.KubernetesHPA


def test_modelplane_simulate_replays_a_users_trace_and_refuses_a_bad_one(tmp_path):
    from typer.testing import CliRunner

    from controlplane.cli import app

    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"{k * 0.01:.2f},{100 + k % 50},{1 + k % 30}"
                                                          for k in range(12_000)]
    path = tmp_path / "mine.csv"
    path.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["simulate", "--trace", str(path), "--replay", "--rate-scale", "20",
                                      "--policy", "hpa", "--policy", "modelplane_horizontal", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "| hpa |" in result.output and "| modelplane_horizontal |" in result.output
    import json

    table = json.loads(out.read_text())
    assert [row["policy"] for row in table["rows"]] == ["hpa", "modelplane_horizontal"]
    assert all(row["conservation_error"] == 0 for row in table["rows"])
    bad = tmp_path / "bad.csv"
    bad.write_text("when,prompt\n")
    refused = CliRunner().invoke(app, ["simulate", "--trace", str(bad)])
    assert refused.exit_code == 2 and "missing column" in refused.output
    refused = CliRunner().invoke(app, ["simulate", "--trace", str(path), "--cold-start", "instant"])
    assert refused.exit_code == 2 and "known: plain, lazy_image, warm_pool" in refused.output


def stored_endpoint(engine, cold_start_s=42.0):
    """gec in the control plane, serving gec.v3 with a cost profile measured on one hardware profile."""
    from pathlib import Path

    from controlplane.cost_profiles import CostProfileStore
    from controlplane.revisions import RevisionStore
    from controlplane.specs import load_spec
    from controlplane.store import EndpointStore

    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "endpoints" / "gec.yaml")
    EndpointStore(engine).put(spec)
    revisions = RevisionStore(engine)
    revision = revisions.create("gec", "gec.v3", "/models/gec", "vllm", {}, 1, details={"cold_start_s": cold_start_s})
    revisions.route("gec", revision.id)
    cost = replace(constant_latency_cost(), target_concurrency=128)
    CostProfileStore(engine).put("gec.v3", "cuda/NVIDIA H200x1", cost.to_json(), cost.target_concurrency, "measured")
    return spec, cost


def test_a_running_endpoint_lends_the_simulator_its_spec_cost_profile_and_cold_start(migrated_engine):
    from controlplane.cli_simulate import endpoint_inputs

    spec, cost = stored_endpoint(migrated_engine)
    found = endpoint_inputs(migrated_engine, "gec")
    assert found.spec == spec and found.cost == cost and found.cold_start_s == 42.0
    assert "gec.v3's cost profile on cuda/NVIDIA H200x1" in found.source
    elsewhere = endpoint_inputs(migrated_engine, "gec", hardware_profile="cpu/AMD EPYC/2cpu")
    assert elsewhere.cost is None and "no cost profile on cpu/AMD EPYC/2cpu" in elsewhere.source
    with pytest.raises(ValueError, match="no endpoint 'nope' in the control plane \\(known: gec\\)"):
        endpoint_inputs(migrated_engine, "nope")


def test_modelplane_simulate_endpoint_runs_on_the_stored_settings_and_measured_cold_start(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from controlplane import db
    from controlplane.cli import app

    url = f"sqlite:///{tmp_path / 'plane.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    stored_endpoint(engine)
    engine.dispose()
    monkeypatch.setenv("MODELPLANE_DATABASE_URL", url)
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["simulate", "--endpoint", "gec", "--cold-start", "measured", "--hours", "0.5",
                                      "--peak-rps", "2000", "--policy", "modelplane_two_axes", "--json", str(out)])
    assert result.exit_code == 0, result.output
    import json

    assumptions = json.loads(out.read_text())["assumptions"]
    assert assumptions["cold_start"] == {"kind": "measured", "median_s": 42.0, "p90_s": 63.0}
    assert assumptions["slo_ms"] == 1000.0 and assumptions["replicas"] == [1, 4]  # the stored spec's
    assert assumptions["target_concurrency"] == 128  # the stored cost profile's, not the preset's 64
    refused = CliRunner().invoke(app, ["simulate", "--endpoint", "nope"])
    assert refused.exit_code == 2 and "no endpoint 'nope'" in refused.output


def test_the_cli_names_match_the_simulator_and_importing_the_cli_leaves_the_simulator_out():
    import subprocess
    import sys

    from autoscale.sim.names import COLD_START_KINDS
    from autoscale.sim.replica import COLD_STARTS

    assert COLD_START_KINDS == tuple(COLD_STARTS)
    probe = "import sys, controlplane.cli; print(sorted({'numpy', 'scipy', 'autoscale.sim.day'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
