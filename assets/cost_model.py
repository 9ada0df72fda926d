"""``cost_model``: what a request costs this version on this hardware, measured, not guessed.

After the eval gate passed (or refused and let the baseline serve,
:mod:`assets.gate_verdict`), the checkpoint that will serve is started on the cluster
backend as a revision of its own (no endpoint routes to it), and a sweep of input length
× output length × concurrency (the spec's ``cost_model`` section) is run against it with
closed-loop load (:mod:`costmodel.measure`). :func:`costmodel.fit.fit_cost_model` fits
``latency_ms(i, o | c) = α_c·i + β_c·o + γ_c`` per concurrency level by non-negative
least squares, reports R² and the error on held-out sweep points, and picks the largest
concurrency whose p99 holds the spec's SLO: the starting ``target_concurrency``. One model
unit is one millisecond of replica time at that operating point, so a request costs
``(α·i + β·o + γ) / c`` units.

The result is stored per (model version, hardware profile) in the control plane, where
the router and the autoscaler read it, and logged to MLflow with the sweep and a plot.
Classic models sweep concurrency only. Two refusals come before the benchmark replica starts:
``min_replicas`` that do not fit (the check ``served_endpoint`` makes) and a grid that could
never be fitted (an LLM's with fewer than two input or output lengths); a sweep where every
request failed, or too small to fit, fails the step after. Each says why, and nothing is
written. The version's MLflow page gets the target level's coefficients as
``modelplane.cost.*`` tags (docs/pipeline-metadata.md).
"""

import json
import math
import tempfile
import time
from pathlib import Path

from dagster import AssetExecutionContext, Failure, MetadataValue, Output, asset

from assets.catalog import GROUP, OWNERS, step_tags
from assets.gate_verdict import serving_checkpoint
from assets.metadata import cost_levels_table, links, mlflow_run_url, png_markdown, sweep_table
from assets.rollout import WaitReady
from assets.quantized_checkpoint import MEASUREMENT_POOL
from assets.served_endpoint import RolloutDriver, choose_runtime, replicas_that_fit
from assets.serving_specs import serving_specs
from assets.source_model import DEPLOY_RETRIES, model_versions
from controlplane.cost_profiles import CostProfileStore
from controlplane.revisions import ONE_OFF, RevisionStore, revision_spec
from controlplane.specs import EndpointSpec
from costmodel.fit import fit_cost_model, grid_problem
from costmodel.measure import classic_input_example, run_sweep
from costmodel.plot import fit_png, latency_png, plot_png
from costmodel.sweep import SweepError, SweepGrid
from pipelines.deploy_plan import cost_sections
from pipelines.registry import parse_partition_key
from pipelines.version_tags import cost_tags
from pipelines.resources import ClusterResource, ControlPlaneResource, RegistryResource
from serving.runtime.model_layout import locate

KIND = "cost_model"
REASON_TAG = "modelplane/cost_model_reason"
BENCH_MODEL_NAME = "cost-sweep"


def grid_of(spec: EndpointSpec, is_llm: bool) -> SweepGrid:
    """The spec's sweep; a classic model has no token axes (inputs and outputs are (0,))."""
    sweep = spec.cost_model
    return SweepGrid(input_tokens=tuple(sweep.input_tokens) if is_llm else (0,),
                     output_tokens=tuple(sweep.output_tokens) if is_llm else (0,),
                     concurrency=tuple(sweep.concurrency), requests_per_point=sweep.requests_per_point,
                     max_point_s=sweep.max_point_s)


def _strictest(specs: list[EndpointSpec]) -> EndpointSpec:
    """The spec whose SLO is tightest: a target that holds it holds the others'."""
    return min(specs, key=lambda s: (s.slo.p99_latency_ms, s.slo.time_to_first_token_ms or float("inf")))


UNMEASURED_TARGET_CONCURRENCY = 1.0  # a classic model with nothing to benchmark it on: one request per replica


def unmeasured(context: AssetExecutionContext, spec: EndpointSpec, model: str, version: str, hardware_profile: str,
               checkpoint: str) -> Output[dict]:
    """No sweep: a classic model logged without an input example, whose spec names none. It is
    deployed at the spec's target concurrency (else one request per replica), and the asset says
    why, in the run's log and its metadata."""
    target = spec.scaling.target_concurrency or UNMEASURED_TARGET_CONCURRENCY
    message = (f"{model} v{version} was logged without an input example and endpoint {spec.name} names none "
               f"(cost_model.example in its spec), so nothing could be sent to measure it: no cost model, target "
               f"concurrency {target:g} ({'scaling.target_concurrency' if spec.scaling.target_concurrency else 'the default'}"
               f"). Log the model with input_example=..., or set cost_model.example, to have it measured.")
    context.log.warning(message)
    value = {"model": model, "version": version, "hardware_profile": hardware_profile, "cost_model": None,
             "target_concurrency": target, "mlflow_run_id": None, "replica_start_s": None}
    return Output(value, metadata={"hardware_profile": hardware_profile, "checkpoint": checkpoint,
                                   "target_concurrency": target, "measured": False,
                                   "warning": MetadataValue.md(f"**Not measured.** {message}")})


@asset(
    partitions_def=model_versions,
    group_name=GROUP,
    kinds={"scipy", "mlflow"},
    owners=OWNERS,
    tags=step_tags(3, "measure", measures=True),
    description="Step 3 of 5. Cost coefficients (α, β, γ per concurrency) and the starting target concurrency, "
                "from a benchmark sweep of the gated checkpoint on the serving hardware; with the sweep, the "
                "coefficients table and plots of latency against concurrency and of the fit.",
    pool=MEASUREMENT_POOL,
    retry_policy=DEPLOY_RETRIES,
)
def cost_model(
    context: AssetExecutionContext,
    quantized_checkpoint: dict,
    control_plane: ControlPlaneResource,
    registry: RegistryResource,
    cluster: ClusterResource,
) -> Output[dict]:
    model, version = parse_partition_key(context.partition_key)
    client = registry.client()
    specs, _ = serving_specs(control_plane.endpoints().list(), model, version, client.alias_version)
    if not specs:
        raise Failure(description=f"no endpoint serves {model} v{version} now, so there is no SLO to size against",
                      allow_retries=False)
    spec = _strictest(specs)
    is_llm = quantized_checkpoint["is_llm"]
    grid = grid_of(spec, is_llm)
    problem = grid_problem(grid, "llm" if is_llm else "classic")
    if problem:  # known from the spec alone: no replica is started for a sweep that cannot be fitted
        raise Failure(description=f"{model} v{version}: the sweep cannot give a cost model: {problem} "
                                  f"(endpoint {spec.name}, cost_model in its spec)", allow_retries=False)
    profile = cluster.hardware_profile()
    reason = context.run.tags.get(REASON_TAG, "new version")
    checkpoint = serving_checkpoint(quantized_checkpoint)
    serve_dir = Path(checkpoint.model_dir)
    runtime = choose_runtime(spec.runtime, is_llm)
    capacity = cluster.capacity()
    for each in specs:  # what served_endpoint would refuse: refused before a sweep's minutes are spent
        replicas_that_fit(each, choose_runtime(each.runtime, is_llm), str(serve_dir),
                          max(1, each.scaling.min_replicas), capacity)
    example = None if is_llm else spec.cost_model.example or classic_input_example(serve_dir)
    if not is_llm and example is None:
        return unmeasured(context, spec, model, version, profile.key, checkpoint.label)
    backend = cluster.client()
    driver = RolloutDriver(backend, RevisionStore(control_plane.engine()), context.log.info)
    context.log.info(f"{model} v{version} ({checkpoint.label}) on {profile.key}: {grid.n_points} sweep points "
                     f"({reason})")
    # Recorded like any revision (the run that owns it spares it from the reaper, and from the
    # backend's converge), then started on the backend.
    bench = driver.revisions.create(BENCH_MODEL_NAME, context.partition_key, str(serve_dir), runtime,
                                    spec.replica.model_dump(), 1,
                                    {"run_id": context.run_id, "purpose": "cost-model sweep", ONE_OFF: True})
    revision_id = bench.id
    backend.apply(revision_spec(bench))
    try:
        if not driver.wait_ready(WaitReady(revision_id, 1)):
            raise Failure(description=f"the benchmark replica of {model} v{version} never became ready: "
                                      f"{driver.not_ready}", allow_retries=not driver.crash_loop)
        [replica] = [r for r in backend.replicas(revision_id) if r.ready][:1]
        replica_start_s = driver.revisions.get(revision_id).details.get("cold_start_s")  # sizes startup probes
        started = time.monotonic()
        if is_llm:
            vocab = locate(serve_dir).config.get("vocab_size")
            samples, points = run_sweep(replica.url, grid, model_name=BENCH_MODEL_NAME, vocab_size=vocab,
                                        log=context.log.info)
        else:
            samples, points = run_sweep(replica.url, grid, classic_body=example, log=context.log.info)
        sweep_s = time.monotonic() - started
    finally:
        backend.delete(revision_id)
        driver.revisions.set_state(revision_id, "retired")
    try:
        fitted = fit_cost_model(samples, points, spec.slo.p99_latency_ms, spec.slo.time_to_first_token_ms,
                                "llm" if is_llm else "classic")
    except SweepError as exc:
        raise Failure(description=f"{model} v{version}: the sweep cannot give a cost model: {exc}",
                      allow_retries=False) from None
    stored = CostProfileStore(control_plane.engine()).put(context.partition_key, profile.key, fitted.to_json(),
                                                          fitted.target_concurrency, reason)
    png = plot_png(points, samples, fitted)
    coefficients = fitted.coefficients
    with tempfile.TemporaryDirectory() as staging:
        Path(staging, "cost_model.json").write_text(json.dumps(fitted.to_json(), indent=2))
        Path(staging, "sweep.json").write_text(json.dumps([p.to_json() for p in points], indent=2))
        Path(staging, "cost_model.png").write_bytes(png)
        run_id = client.log_derived(model, version, KIND, Path(staging),
                                    tags={"modelplane.hardware_profile": profile.key, "modelplane.reason": reason},
                                    metrics={k: v for k, v in {
                                        "alpha_ms_per_input_token": coefficients.alpha_ms_per_input_token,
                                        "beta_ms_per_output_token": coefficients.beta_ms_per_output_token,
                                        "gamma_ms": coefficients.gamma_ms, "r2": fitted.r2,
                                        "heldout_median_abs_pct_error": fitted.heldout_median_abs_pct_error,
                                        "target_concurrency": fitted.target_concurrency}.items() if math.isfinite(v)})
    client.set_version_tags(model, version, cost_tags(fitted.to_json(), profile.key))
    if not fitted.slo_met:
        context.log.warning(fitted.slo_message)
    value = {"model": model, "version": version, "hardware_profile": profile.key, "cost_model": fitted.to_json(),
             "target_concurrency": stored.target_concurrency, "mlflow_run_id": run_id,
             "replica_start_s": replica_start_s}
    return Output(value, metadata={
        "hardware_profile": profile.key,
        "checkpoint": checkpoint.label,
        "cost_sections": cost_sections(spec),
        "reason": reason,
        "alpha_ms_per_input_token": round(coefficients.alpha_ms_per_input_token, 4),
        "beta_ms_per_output_token": round(coefficients.beta_ms_per_output_token, 3),
        "gamma_ms": round(coefficients.gamma_ms, 2),
        "target_concurrency": fitted.target_concurrency,
        "slo_met": fitted.slo_met,
        "slo": fitted.slo_message,
        "r2": round(fitted.r2, 4) if math.isfinite(fitted.r2) else "n/a",
        "heldout_median_abs_pct_error": (round(fitted.heldout_median_abs_pct_error, 2)
                                         if math.isfinite(fitted.heldout_median_abs_pct_error) else "n/a (nothing held out)"),
        "sweep_points": len(points),
        "sweep_requests": len(samples),
        "sweep_s": round(sweep_s, 1),
        "mlflow_run_id": run_id,
        "coefficients": MetadataValue.md(cost_levels_table(fitted.to_json()["levels"], fitted.target_concurrency,
                                                          (max(grid.input_tokens), max(grid.output_tokens)))),
        "sweep": MetadataValue.md(sweep_table([p.to_json() for p in points])),
        "latency_plot": png_markdown(latency_png(points, fitted), "measured latency against concurrency"),
        "fit_plot": png_markdown(fit_png(samples, fitted), "cost model fit: predicted against measured latency"),
        **links(mlflow_run=mlflow_run_url(registry.web_url(), run_id)),
    })
