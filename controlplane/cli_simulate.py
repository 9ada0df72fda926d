"""``modelplane simulate``: replay a day (or your own trace) against every autoscaling policy, in seconds.

The fleet simulator (``autoscale.sim``, docs/simulation.md) drives the controller's own
policy objects with a fake clock, beside Kubernetes HPA, Knative, Ray Serve and AIBrix at
their defaults, static peak and an oracle, on the same demand and replica model.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from autoscale.sim.day import POLICIES, DaySettings, run_day, run_demand
from autoscale.sim.demand import TraceError, read_trace, replay
from autoscale.sim.replica import COLD_STARTS, h100_small
from autoscale.sim.report import plot_day, table_markdown
from controlplane.specs import SpecError, load_spec
from costmodel.fit import CostModel

console = Console(soft_wrap=True)
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "azure-llm-trace-2023" / \
    "AzureLLMInferenceTrace_conv.csv"


def _cost_model(path: Path | None, trace, slo_ms: float | None) -> CostModel:
    if path is None:
        return h100_small(trace.input_tokens, trace.output_tokens, **({"slo_p99_ms": slo_ms} if slo_ms else {}))
    try:
        data = json.loads(path.read_text())
        cost = CostModel.from_json(data.get("cost_model", data))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise typer.BadParameter(f"{path} is not a cost model JSON (CostModel.to_json, as the cost_model asset "
                                 f"stores it): {exc}", param_hint="--cost-profile") from None
    if slo_ms:
        cost = CostModel(**{**cost.__dict__, "slo_p99_ms": slo_ms})
    return cost


def simulate(
    trace: Path = typer.Option(None, "--trace", help="CSV with TIMESTAMP,ContextTokens,GeneratedTokens (the Azure "
                               "LLM trace's columns); default: the Azure conversation trace in ../shared/data."),
    replay_trace: bool = typer.Option(False, "--replay", help="Replay the trace's own arrivals per second instead "
                                      "of the synthetic day (its sizes are used either way)."),
    rate_scale: float = typer.Option(1.0, "--rate-scale", min=0.001, help="With --replay: × this rate, as that "
                                     "many superposed shifted copies of the trace."),
    peak_rps: float = typer.Option(200_000.0, "--peak-rps", min=1.0, help="The synthetic day's peak, req/s."),
    hours: float = typer.Option(24.0, "--hours", min=0.1, max=24.0, help="Simulate the first HOURS of the day."),
    cold_start: str = typer.Option("plain", "--cold-start", help=f"One of {', '.join(COLD_STARTS)}."),
    cost_profile: Path = typer.Option(None, "--cost-profile", help="A cost model JSON (CostModel.to_json); "
                                      "default: the h100_small preset (about 1,200 req/s per replica)."),
    slo_ms: float = typer.Option(None, "--slo-ms", min=1.0, help="The per-request latency SLO; default: the cost "
                                 "model's p99 SLO."),
    spec: Path = typer.Option(None, "--spec", help="An endpoint spec (YAML): its slo.p99_latency_ms, "
                              "scaling.min_replicas/max_replicas/target_concurrency/scale_to_zero_grace_s apply."),
    policy: list[str] = typer.Option(None, "--policy", help=f"Repeat to choose; default all: {', '.join(POLICIES)}."),
    max_replicas: int = typer.Option(None, "--max-replicas", min=1, help="Default: the spec's, else 400."),
    seed: int = typer.Option(0, "--seed"),
    json_out: Path = typer.Option(None, "--json", help="Write the table and assumptions here."),
    png_out: Path = typer.Option(None, "--png", help="Plot replicas against demand here."),
) -> None:
    """Simulate a day of traffic against every autoscaling policy and print the table."""
    try:
        scaling = {"max_replicas": 400}
        if spec is not None:
            endpoint = load_spec(spec)
            scaling = {"min_replicas": endpoint.scaling.min_replicas, "max_replicas": endpoint.scaling.max_replicas,
                       "target_concurrency": endpoint.scaling.target_concurrency,
                       "scale_to_zero_grace_s": endpoint.scaling.scale_to_zero_grace_s}
            slo_ms = slo_ms or endpoint.slo.p99_latency_ms
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
    cost = _cost_model(cost_profile, source, slo_ms)
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
