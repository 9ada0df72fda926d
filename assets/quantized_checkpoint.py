"""``quantized_checkpoint``: the source LLM's weights on the 8-bit path the hardware runs fastest.

For an LLM, the spec's ``quantization`` section and the hardware profile of the cluster
give a plan (:mod:`quantization.plan`: FP8 W8A8 on GPUs, INT8 W8A8 on CPUs, per-channel
weight scales, dynamic per-token activations, ``lm_head`` left alone). A plan the engine
cannot run fails here, naming both (:mod:`quantization.engine_support`). The worker
(:mod:`quantization.worker`) runs in the quantization environment through Dagster Pipes,
saves a compressed-tensors checkpoint beside the tokenizer, and reports sizes, per-group
weight error and time; the checkpoint is then logged to MLflow, linked to its source
version by tags.

A checkpoint made before from the same source content, plan and quantizer is linked
from the model store's ``quantized/`` entries instead of being quantized again
(:mod:`quantization.store`; the metadata says ``reused``).
Classic models, and ``scheme: none``, pass through: the value points at the source files
and the metadata says the checkpoint is not quantized. The ``eval_gate`` check
(:mod:`assets.eval_gate`) must pass before anything downstream runs. The version's MLflow page
gets the ``modelplane.quantization.*`` tags (docs/pipeline-metadata.md).
"""


import json
from pathlib import Path

from dagster import AssetExecutionContext, Failure, MetadataValue, Output, asset

from assets.catalog import GROUP, OWNERS, step_tags
from assets.metadata import layer_group_table, links, mlflow_run_url, quantization_sizes_table, worst_layers_table
from assets.serving_specs import agreed_quantization, serving_specs
from assets.source_model import model_versions
from evaluation.engine_run import content_digest
from evaluation.gec_data import calibration_texts
from pipelines.deploy_plan import checkpoint_sections
from pipelines.registry import parse_partition_key
from pipelines.version_tags import quantization_tags
from pipelines.resources import (ClusterResource, ControlPlaneResource, ModelStoreResource, QuantizerResource,
                                 RegistryResource)
from quantization.engine_support import check_supported
from quantization.plan import plan_for
from quantization.reconstruction import layer_group
from quantization.store import REPORT_FILE, keep, link_tree, quantizer_identity, store_key, stored
from quantization.worker import metadata_of
from serving.runtime.model_layout import locate

KIND = "quantized_checkpoint"
# Quantizing, evaluating and benchmarking share this pool (limit 1 in dagster.yaml): a cost
# model measured while another run quantizes on the same cores would be wrong.
MEASUREMENT_POOL = "modelplane-measurement"


def _passed_through(source_model: dict, profile_key: str, engine: str, why: str, sections: str) -> Output[dict]:
    value = {"model": source_model["model"], "version": source_model["version"], "quantized": False,
             "is_llm": source_model["is_llm"], "serve_dir": source_model["local_dir"],
             "source_dir": source_model["local_dir"], "scheme": None, "engine": engine,
             "hardware_profile": profile_key, "reason": why}
    return Output(value, metadata={"quantized": False, "scheme": "none", "reason": why, "hardware_profile": profile_key,
                                   "serve_dir": MetadataValue.path(source_model["local_dir"]),
                                   "checkpoint_sections": sections})


@asset(
    partitions_def=model_versions,
    group_name=GROUP,
    kinds={"pytorch", "mlflow"},
    owners=OWNERS,
    tags=step_tags(2, "quantize", measures=True),
    description="Step 2 of 5. The LLM quantized for the serving hardware (FP8 or INT8 W8A8, compressed-tensors), "
                "with the weight error per layer group and the sizes; classic models pass through. Its eval_gate "
                "check must pass (or let the baseline serve) before anything downstream runs.",
    pool=MEASUREMENT_POOL,
)
def quantized_checkpoint(
    context: AssetExecutionContext,
    source_model: dict,
    control_plane: ControlPlaneResource,
    registry: RegistryResource,
    cluster: ClusterResource,
    model_store: ModelStoreResource,
    quantizer: QuantizerResource,
) -> Output[dict]:
    model, version = parse_partition_key(context.partition_key)
    client = registry.client()
    profile = cluster.hardware_profile()
    specs, _ = serving_specs(control_plane.endpoints().list(), model, version, client.alias_version)
    sections = checkpoint_sections(specs[0]) if specs else ""  # the specs agree on these sections
    if not source_model["is_llm"]:
        why = f"{source_model['flavor']} model: served as registered"
        client.set_version_tags(model, version, quantization_tags(None, profile.key, why))
        return _passed_through(source_model, profile.key, profile.engine, why, sections)
    settings = agreed_quantization(specs)
    plan = plan_for(scheme=settings.scheme.value, quantize_attention=settings.quantize_attention,
                    weight_granularity=settings.weight_granularity.value, kv_cache=settings.kv_cache,
                    accelerator=profile.accelerator)
    if plan is None:
        client.set_version_tags(model, version, quantization_tags(None, profile.key, "quantization.scheme is none"))
        return _passed_through(source_model, profile.key, profile.engine, "quantization.scheme is none", sections)
    try:
        check_supported(plan, profile.engine)
    except ValueError as exc:
        raise Failure(description=str(exc), allow_retries=False) from None

    layout = locate(Path(source_model["local_dir"]))
    output_dir = model_store.version_dir(model, version, f"quantized-{plan.label}")  # one per plan
    extras = {"checkpoint_dir": str(layout.checkpoint_dir), "tokenizer_dir": str(layout.tokenizer_dir),
              "output_dir": str(output_dir), "plan": plan.to_json()}
    if plan.kv_cache:
        extras["calibration_texts"] = calibration_texts()
    key = store_key(content_digest(layout.checkpoint_dir), plan.to_json(), extras.get("calibration_texts"),
                    quantizer_identity(Path(quantizer.python), Path(quantizer.worker)))
    kept = stored(model_store.quantized_dir(), key)
    if kept is not None:
        context.log.info(f"{model} v{version}: {plan.label} of this source content was made before ({kept}); "
                         "linked, not quantized again")
        link_tree(kept, output_dir)
        report = json.loads((output_dir / REPORT_FILE).read_text())
        reported = {**metadata_of(report), "reused": f"quantized before from the same source content, plan and "
                                                    f"quantizer (store entry {key[:16]}); not run again"}
    else:
        context.log.info(f"{model} v{version}: {plan.label} for {profile.key} ({profile.engine})")
        reported = quantizer.run(context, extras).get_materialize_result().metadata
        report = json.loads((output_dir / REPORT_FILE).read_text())
        keep(model_store.quantized_dir(), key, output_dir)
    groups = report["weight_error"]["groups"]
    client.set_version_tags(model, version, quantization_tags(plan.label, profile.key))
    run_id = client.log_derived(
        model, version, KIND, output_dir,
        tags={"modelplane.scheme": plan.label, "modelplane.hardware_profile": profile.key},
        metrics={"size_before_mb": report["size_before_bytes"] / 1e6, "size_after_mb": report["size_after_bytes"] / 1e6,
                 **{f"weight_error_{group}": error for group, error in groups.items()}},
    )
    value = {"model": model, "version": version, "quantized": True, "is_llm": True, "serve_dir": str(output_dir),
             "source_dir": source_model["local_dir"], "scheme": plan.label, "plan": plan.to_json(),
             "engine": profile.engine, "hardware_profile": profile.key, "mlflow_run_id": run_id,
             "weight_error": groups}
    return Output(value, metadata={
        **reported,
        "quantized": True,
        "engine": profile.engine,
        "hardware_profile": profile.key,
        "mlflow_run_id": run_id,
        "quantization_config": MetadataValue.json(report["quantization_config"]),
        "checkpoint_sections": sections,
        "serve_dir": MetadataValue.path(str(output_dir)),
        "weight_error_by_group": MetadataValue.md(layer_group_table(groups, report["weight_error"]["layers"],
                                                                    layer_group)),
        "worst_layers": MetadataValue.md(worst_layers_table(report["weight_error"]["layers"])),
        "sizes": MetadataValue.md(quantization_sizes_table(report)),
        **links(mlflow_run=mlflow_run_url(registry.web_url(), run_id)),
    })
