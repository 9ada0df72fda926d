"""``eval_gate``: a blocking check on ``quantized_checkpoint``; nothing downstream runs unless it passes.

The candidate (the quantized checkpoint) is served by the real engine and evaluated on the
spec's evaluation set; so is the unquantized baseline (the registered version's own
weights), and, when an endpoint is serving another version now, that revision's checkpoint.
Each result is kept by what decides it (the checkpoint's content, the set, the engine and the
hardware profile: :mod:`evaluation.engine_run`), so a checkpoint evaluated before on this
engine, such as the revision serving now or a version registered again from the same weights,
is read back instead of served again. :func:`evaluation.gate.decide` compares them
against the spec's thresholds: the task metric must not drop by more than
``max_regression`` against either, per-token NLL on held-out text must not rise by more
than ``max_nll_increase``, and at least ``min_agreement`` of the greedy outputs must equal
the baseline's. A task-metric drop counts only when it is also unlikely to be noise (a
paired test on the per-example outcomes, ``significance``); the decision, the p-value, the
interval, the example count and the kernels the engine ran (``cluster.hardware``: AMX or
not) are in the metadata.

What a refusal leads to (:mod:`assets.gate_verdict` records it for the steps downstream):

- an endpoint of this model serves a revision now: severity ERROR, the deploy run stops
  (no cost model, no image, no traffic moves) and that revision keeps serving;
- nothing serves yet and ``eval_gate.on_failure`` is ``serve_baseline`` (the default): the
  check fails with severity WARN, which does not block, and the run goes on with the
  unquantized baseline the gate just measured;
- ``on_failure: block``: severity ERROR, nothing serves until a version passes.

A candidate checkpoint the engine cannot load is refused the same way, with the scheme, the
engine and the end of the engine's log; a baseline or serving revision that cannot be
evaluated stops the run (there is nothing to judge against). The version's MLflow page gets
the ``modelplane.gate.*`` tags, and, when a refusal stops the run, why it does not serve
(docs/pipeline-metadata.md).
"""


import warnings
from dataclasses import asdict
from pathlib import Path

from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, MetadataValue, asset_check

from assets.gate_verdict import record_verdict
from assets.metadata import bullet_list, gate_checks_table, scores_table, worst_examples_table
from assets.quantized_checkpoint import MEASUREMENT_POOL, quantized_checkpoint
from assets.serving_specs import agreed_eval_gate, serving_specs
from assets.serving_state import record_serving
from assets.source_model import model_versions
from controlplane.revisions import RevisionStore
from controlplane.specs import GateFailure
from evaluation.datasets import eval_set as load_eval_set
from evaluation.engine_eval import EngineEvalError
from evaluation.engine_run import EngineStartError, evaluate_checkpoint, installed_engine
from evaluation.gate import GateThresholds, decide
from pipelines.registry import parse_partition_key
from pipelines.deploy_plan import GATE_TAG
from pipelines.resources import ClusterResource, ControlPlaneResource, ModelStoreResource, RegistryResource
from pipelines.version_tags import gate_tags, interval_text
from quantization.engine_support import kernels

# Partitioned asset checks are "preview" in Dagster 1.13 (pinned in requirements/main.lock);
# the gate must be per model version, so it uses them and says so here instead of per run.
warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec")


def _serving_dirs(revisions: RevisionStore, endpoints: list[str], candidate_dir: str, source_dir: str) -> list[str]:
    """Checkpoints the named endpoints serve now, other than this version's own."""
    traffic = revisions.traffic()
    dirs = []
    for endpoint in endpoints:
        revision = revisions.get(traffic[endpoint]) if endpoint in traffic else None
        if revision and revision.model_dir not in (candidate_dir, source_dir) and Path(revision.model_dir).is_dir():
            dirs.append(revision.model_dir)
    return sorted(set(dirs))


def _interval(checks) -> str | None:
    """The paired tests behind the task checks, one line each (the ``modelplane.gate.interval`` tag)."""
    return "; ".join(interval_text(c.paired.to_json(), c.name) for c in checks if c.paired) or None


def _refusal(context: AssetCheckExecutionContext, candidate: dict, reasons: list[str], something_serves: bool,
             fall_back: bool, kernels_used: str, metadata: dict, record_tags) -> AssetCheckResult:
    """A refused candidate: the baseline serves instead (WARN, not blocking) or the run stops (ERROR).
    ``record_tags(outcome, reasons, stops_here)`` writes the refusal on the MLflow version."""
    if something_serves:
        outcome = "refused; the revision serving now keeps serving"
    elif fall_back:
        outcome = ("refused; nothing serves this endpoint yet, so it serves the unquantized baseline instead "
                   "(eval_gate.on_failure: serve_baseline)")
    else:
        outcome = "refused; nothing is served (eval_gate.on_failure: block)"
    context.log.warning(f"eval gate: {candidate['scheme']} {outcome}")
    record_verdict(candidate, "baseline" if fall_back else "none", reasons, kernels_used)
    record_tags(outcome, reasons, not fall_back)
    if not fall_back:  # the registry sensor does not ask again for a version the gate refused
        context.instance.add_run_tags(context.run.run_id, {GATE_TAG: "refused"})
    metadata = {**metadata, "decision": outcome, "reasons": MetadataValue.md(bullet_list(reasons))}
    return AssetCheckResult(passed=False, severity=AssetCheckSeverity.WARN if fall_back else AssetCheckSeverity.ERROR,
                            metadata=metadata)


@asset_check(
    asset=quantized_checkpoint,
    blocking=True,
    partitions_def=model_versions,
    pool=MEASUREMENT_POOL,
    description="The quantized candidate on the real engine against the unquantized baseline and the "
                "revision serving now; a refusal stops the deploy before any traffic moves, or, where nothing "
                "serves yet, lets the unquantized baseline serve instead (eval_gate.on_failure). Shows every "
                "check with its bound and the paired test's interval, the scores, and the worst examples.",
    metadata={"spec_section": "eval_gate", "docs": "docs/quantization.md"},
)
def eval_gate(
    context: AssetCheckExecutionContext,
    quantized_checkpoint: dict,
    control_plane: ControlPlaneResource,
    registry: RegistryResource,
    model_store: ModelStoreResource,
    cluster: ClusterResource,
) -> AssetCheckResult:
    candidate = quantized_checkpoint
    model, version = parse_partition_key(context.partition_key)
    client = registry.client()
    if not candidate["quantized"]:
        client.set_version_tags(model, version, gate_tags("not gated", f"not gated: {candidate['reason']}"))
        return AssetCheckResult(passed=True, metadata={"compared": "nothing: " + candidate["reason"]})
    specs, _ = serving_specs(control_plane.endpoints().list(), model, version, client.alias_version)
    gate = agreed_eval_gate(specs)
    thresholds = GateThresholds.from_spec(gate)
    data = load_eval_set(gate.dataset).sample(gate.max_examples)
    logs = Path(model_store.version_dir(model, version, "eval"))
    log = context.log.info
    profile = cluster.hardware_profile()
    kernels_used = kernels(candidate["scheme"].split("-")[0], profile)

    revisions = RevisionStore(control_plane.engine())
    serving_dirs = _serving_dirs(revisions, [s.name for s in specs], candidate["serve_dir"], candidate["source_dir"])
    traffic = revisions.traffic()
    something_serves = any(spec.name in traffic for spec in specs)
    fall_back = not something_serves and gate.on_failure is GateFailure.serve_baseline
    interval = None  # the paired tests' line, once the candidate was compared

    def record_tags(outcome: str, reasons: list[str], stops_here: bool) -> None:
        client.set_version_tags(model, version, gate_tags("refused", outcome, interval, reasons))
        if stops_here:  # with serve_baseline, served_endpoint writes where the baseline serves
            record_serving(client, revisions, control_plane.router_url, context.partition_key,
                           f"the eval gate refused {candidate['scheme']}: " + "; ".join(reasons))

    # The specs agree on one section, and a model's endpoints normally serve one revision.
    roles = [("candidate", candidate["serve_dir"]), ("baseline", candidate["source_dir"])]
    roles += [("serving", serving_dirs[0])] if serving_dirs else []
    # What decides a result besides the checkpoint and the set (the kernels follow from the
    # checkpoint's scheme and this profile, whose key names the ISA level: AMX only where granted).
    engine = f"{installed_engine()} on {profile.key}"
    measured_on = {"hardware_profile": profile.key, "cpu_amx": profile.amx, "kernels": kernels_used,
                   "scheme": candidate["scheme"], "dataset": data.name, "compared_with_serving": bool(serving_dirs)}
    results = {}
    for role, model_dir in roles:
        try:
            results[role] = evaluate_checkpoint(Path(model_dir), data, logs / f"{role}-engine.log",
                                                results_dir=model_store.evaluations_dir(), engine=engine, log=log)
        except (EngineStartError, EngineEvalError) as exc:
            what = (f"{candidate['engine']} could not load the {candidate['scheme']} checkpoint"
                    if role == "candidate" and isinstance(exc, EngineStartError)
                    else f"the {role} checkpoint ({model_dir}) could not be evaluated on {candidate['engine']}")
            context.log.error(f"{what}: {str(exc)[-500:]}")
            failure = {**measured_on, "reason": what,
                       "engine_log_tail": MetadataValue.md(f"```\n{str(exc)[-3000:]}\n```")}
            if role == "candidate":
                return _refusal(context, candidate, [what], something_serves, fall_back, kernels_used, failure,
                                record_tags)
            client.set_version_tags(model, version, gate_tags("could not judge", what))
            return AssetCheckResult(passed=False, severity=AssetCheckSeverity.ERROR, metadata=failure)
    candidate_result, baseline_result = results["candidate"], results["baseline"]
    serving_result = results.get("serving")

    decision = decide(candidate_result, baseline_result, serving_result, thresholds, data)
    for line in decision.reasons:
        context.log.warning(line)
    metadata = {
        **measured_on,
        "examples": candidate_result.n_examples,
        "checks": MetadataValue.md("\n".join(f"- {'✅' if c.passed else '❌'} {c.summary}" for c in decision.checks)),
        "paired_tests": MetadataValue.json({c.name: c.paired.to_json() for c in decision.checks if c.paired}),
        "candidate": MetadataValue.json({"task": candidate_result.task, "nll": candidate_result.nll}),
        "baseline": MetadataValue.json({"task": baseline_result.task, "nll": baseline_result.nll}),
        "serving": MetadataValue.json({"task": serving_result.task, "nll": serving_result.nll}
                                      if serving_result else {}),
        "worst_examples": MetadataValue.md(worst_examples_table([w.to_row() for w in decision.worst_examples])),
        "checks_table": MetadataValue.md(gate_checks_table(
            [{**asdict(c), "paired": c.paired.to_json() if c.paired else None} for c in decision.checks])),
        "scores": MetadataValue.md(scores_table(
            {role: {"task": r.task, "nll": r.nll} for role, r in results.items()}, thresholds.metric)),
    }
    interval = _interval(decision.checks)
    if not decision.passed:
        return _refusal(context, candidate, decision.reasons, something_serves, fall_back, kernels_used, metadata,
                        record_tags)
    record_verdict(candidate, "candidate", [], kernels_used)
    client.set_version_tags(model, version, gate_tags("passed", f"passed: {candidate['scheme']} serves", interval))
    return AssetCheckResult(passed=True, severity=AssetCheckSeverity.ERROR,
                            metadata={**metadata, "decision": f"passed: {candidate['scheme']} serves"})
