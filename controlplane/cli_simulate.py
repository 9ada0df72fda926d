"""``modelplane simulate``: replay a day (or your own trace) against every autoscaling policy, in seconds.

The fleet simulator (``autoscale.sim``, docs/simulation.md) drives the controller's own
policy objects with a fake clock, beside Kubernetes HPA, Knative, Ray Serve and AIBrix at
their defaults, static peak and an oracle, on the same demand and replica model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from autoscale.sim.names import COLD_START_KINDS, POLICIES

if TYPE_CHECKING:  # the simulator (numpy, scipy) is imported when the command runs, not with the CLI
    from sqlalchemy import Engine

    from controlplane.specs import EndpointSpec
    from costmodel.fit import CostModel


console = Console(soft_wrap=True)


def _cost_model(path: Path | None, trace, slo_ms: float | None) -> CostModel:
    from autoscale.sim.replica import h100_small
    from costmodel.fit import CostModel

    if path is None:
        return h100_small(trace.input_tokens, trace.output_tokens, **({"slo_p99_ms": slo_ms} if slo_ms else {}))
    try:
        data = json.loads(path.read_text())
        cost = CostModel.from_json(data.get("cost_model", data))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise typer.BadParameter(f"{path} is not a cost model JSON (CostModel.to_json, as the cost_model asset "
                                 f"stores it): {exc}", param_hint="--cost-profile") from None
    return _with_slo(cost, slo_ms)


def _with_slo(cost: CostModel, slo_ms: float | None) -> CostModel:
    return replace(cost, slo_p99_ms=slo_ms) if slo_ms else cost


@dataclass(frozen=True)
class EndpointInputs:
    """What a running platform knows of one endpoint: its spec, and its serving version's cost model and cold start."""

    spec: EndpointSpec
    cost: CostModel | None
    cold_start_s: float | None
    source: str


def endpoint_inputs(engine: Engine, name: str, hardware_profile: str | None = None) -> EndpointInputs:
    """The spec of ``name``, and the cost profile of the version it serves on ``hardware_profile``
    (default: the newest profile of that version on any hardware), from the control-plane stores.

    Raises ValueError saying what is missing: an unknown endpoint, or one that serves nothing yet.
    """
    from controlplane.cost_profiles import CostProfileStore
    from controlplane.revisions import RevisionStore
    from controlplane.store import EndpointStore
    from costmodel.fit import CostModel
    spec = EndpointStore(engine).get(name)
    if spec is None:
        known = ", ".join(s.name for s in EndpointStore(engine).list()) or "none"
        raise ValueError(f"no endpoint {name!r} in the control plane (known: {known})")
    revisions = RevisionStore(engine)
    serving = revisions.traffic().get(name)
    revision = revisions.get(serving) if serving else None
    if revision is None:
        return EndpointInputs(spec, None, None, f"endpoint {name}: serves no revision yet, so no cost profile")
    store = CostProfileStore(engine)
    profile = store.get(revision.partition_key, hardware_profile) if hardware_profile is not None \
        else store.newest(revision.partition_key)
    cold = (revision.details or {}).get("cold_start_s")
    cold_start_s = float(cold) if isinstance(cold, (int, float)) and cold > 0 else None
    if profile is None:
        where = f" on {hardware_profile}" if hardware_profile else ""
        return EndpointInputs(spec, None, cold_start_s, f"endpoint {name}: {revision.partition_key} has no cost "
                              f"profile{where} yet")
    return EndpointInputs(spec, CostModel.from_json(profile.model), cold_start_s,
                          f"endpoint {name}: {revision.partition_key}'s cost profile on {profile.hardware_profile}")


def simulate(
    trace: Path = typer.Option(None, "--trace", help="CSV with TIMESTAMP,ContextTokens,GeneratedTokens (the Azure "
                               "LLM trace's columns); default: the Azure conversation trace in ../shared/data."),
    replay_trace: bool = typer.Option(False, "--replay", help="Replay the trace's own arrivals per second instead "
                                      "of the synthetic day (its sizes are used either way)."),
    rate_scale: float = typer.Option(1.0, "--rate-scale", min=0.001, help="With --replay: × this rate, as that "
                                     "many superposed shifted copies of the trace."),
    peak_rps: float = typer.Option(200_000.0, "--peak-rps", min=1.0, help="The synthetic day's peak, req/s."),
    hours: float = typer.Option(24.0, "--hours", min=0.1, max=24.0, help="Simulate the first HOURS of the day."),
    cold_start: str = typer.Option("plain", "--cold-start", help=f"One of {', '.join(COLD_START_KINDS)}, or measured "
                                   "(with --endpoint: the serving revision's own, as the median; p90 = 1.5 ×)."),
    cost_profile: Path = typer.Option(None, "--cost-profile", help="A cost model JSON (CostModel.to_json); "
                                      "default: the h100_small preset (about 1,200 req/s per replica)."),
    slo_ms: float = typer.Option(None, "--slo-ms", min=1.0, help="The per-request latency SLO; default: the cost "
                                 "model's p99 SLO."),
    spec: Path = typer.Option(None, "--spec", help="An endpoint spec (YAML): its slo.p99_latency_ms, "
                              "scaling.min_replicas/max_replicas/target_concurrency/scale_to_zero_grace_s apply."),
    endpoint: str = typer.Option(None, "--endpoint", help="An endpoint of the running platform: its stored spec, "
                                 "and the cost profile and measured cold start of the version it serves."),
    hardware: str = typer.Option(None, "--hardware", help="With --endpoint: the hardware profile whose cost "
                                 "profile to use (default: the newest measured)."),
    policy: list[str] = typer.Option(None, "--policy", help=f"Repeat to choose; default all: {', '.join(POLICIES)}."),
    max_replicas: int = typer.Option(None, "--max-replicas", min=1, help="Default: the spec's, else 400."),
    seed: int = typer.Option(0, "--seed"),
    json_out: Path = typer.Option(None, "--json", help="Write the table and assumptions here."),
    png_out: Path = typer.Option(None, "--png", help="Plot replicas against demand here."),
) -> None:
    """Simulate a day of traffic against every autoscaling policy and print the table."""
    from autoscale.sim.day import DaySettings, run_day, run_demand
    from autoscale.sim.demand import DEFAULT_TRACE, TraceError, read_trace, replay
    from autoscale.sim.report import plot_day, table_markdown
    from controlplane import db
    from controlplane.settings import Settings
    from controlplane.specs import SpecError, load_spec

    try:
        scaling = {"max_replicas": 400}
        if spec is not None and endpoint is not None:
            raise ValueError("--spec and --endpoint both give the endpoint's settings: pass one")
        stored = None
        if endpoint is not None:
            stored = endpoint_inputs(db.make_engine(Settings.from_env().database_url), endpoint, hardware)
            console.print(f"[dim]{stored.source}[/dim]", highlight=False)
            scaling["measured_cold_start_s"] = stored.cold_start_s
        elif hardware is not None:
            raise ValueError("--hardware chooses the cost profile of --endpoint; pass --endpoint too")
        loaded = load_spec(spec) if spec is not None else stored.spec if stored is not None else None
        if loaded is not None:
            scaling.update(min_replicas=loaded.scaling.min_replicas, max_replicas=loaded.scaling.max_replicas,
                           target_concurrency=loaded.scaling.target_concurrency,
                           scale_to_zero_grace_s=loaded.scaling.scale_to_zero_grace_s)
            slo_ms = slo_ms or loaded.slo.p99_latency_ms
        if max_replicas is not None:
            scaling["max_replicas"] = max_replicas
        settings = DaySettings(peak_rps=peak_rps, seed=seed, cold_start=cold_start,
                               policies=tuple(policy) if policy else POLICIES, duration_s=int(hours * 3600), **scaling)
        source = read_trace(trace or DEFAULT_TRACE)
    except OSError as exc:
        console.print(f"[red]error:[/red] cannot read {exc.filename}: {exc.strerror}", highlight=False)
        raise typer.Exit(2) from None
    except (ValueError, TraceError, SpecError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    if rate_scale != 1.0 and not replay_trace:
        console.print("[red]error:[/red] --rate-scale applies to --replay only (the synthetic day takes --peak-rps)")
        raise typer.Exit(2)
    cost = _cost_model(cost_profile, source, slo_ms) if cost_profile is not None or stored is None or \
        stored.cost is None else _with_slo(stored.cost, slo_ms)
    log = lambda line: console.print(f"[dim]{line}[/dim]", highlight=False)  # noqa: E731
    if replay_trace:
        demand = replay(source, rate_scale, seed)
        result = run_demand(demand, lambda: demand, cost, settings, log)  # yesterday: the same traffic
    else:
        result = run_day(source, settings, cost, log)
    print(table_markdown(result["rows"]))
    for key, value in result["assumptions"].items():
        console.print(f"[dim]{key}: {value}[/dim]", highlight=False)
    if json_out:
        json_out.write_text(json.dumps({"rows": result["rows"], "assumptions": result["assumptions"]}, indent=2) + "\n")
    if png_out:
        plot_day(result["runs"], str(png_out), f"replicas against demand, cold start {cold_start}")
