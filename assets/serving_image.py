"""``serving_image``: the version's OCI image, built without Docker, and its seekable form.

Between ``cost_model`` and ``served_endpoint``: for each runtime the version's endpoints use,
an image of two layers — the runtime environment (shared by every version on this
environment, built once) and the checkpoint that will serve (:mod:`assets.gate_verdict`) —
pushed to the OCI registry, plus the seekable artifact that refers to it
(:mod:`images.serving_image`). ``served_endpoint`` starts the replicas from it. With the
``images`` resource's ``mode: off`` nothing is built and replicas start in place.
"""

import re

from dagster import AssetExecutionContext, MetadataValue, Output, asset

from assets.catalog import GROUP, OWNERS, step_tags
from assets.gate_verdict import serving_checkpoint
from assets.metadata import image_digest_url, image_layers_table
from assets.served_endpoint import choose_runtime
from assets.serving_specs import serving_specs
from assets.source_model import DEPLOY_RETRIES, model_versions
from controlplane.specs import Runtime
from pipelines.registry import parse_partition_key
from pipelines.resources import ControlPlaneResource, ImagesResource, RegistryResource


def repository_name(prefix: str, model: str) -> str:
    """An OCI repository name for a registered model (lowercase, [a-z0-9._-] runs, '/'-joined).

    >>> repository_name("modelplane", "Tiny LLM_v2")
    'modelplane/tiny-llm_v2'
    """
    name = re.sub(r"[^a-z0-9._-]+", "-", model.lower()).strip("-._") or "model"
    return f"{prefix}/{name}"


@asset(
    partitions_def=model_versions,
    group_name=GROUP,
    kinds={"oci"},
    owners=OWNERS,
    tags=step_tags(4, "build"),
    description="Step 4 of 5. The version's OCI serving image (runtime layer + model layer, built without Docker) "
                "and its lazily fetchable, seekable form, with links to both by digest and the layers' sizes.",
    retry_policy=DEPLOY_RETRIES,
)
def serving_image(
    context: AssetExecutionContext,
    quantized_checkpoint: dict,
    cost_model: dict,
    control_plane: ControlPlaneResource,
    registry: RegistryResource,
    images: ImagesResource,
) -> Output[dict]:
    from pathlib import Path

    from images.serving_image import build_serving_image

    if images.mode == "off":
        return Output({"mode": "off", "images": {}},
                      metadata={"mode": "off", "why": "the images resource has mode: off; replicas start in place"})
    model, version = parse_partition_key(context.partition_key)
    specs, _ = serving_specs(control_plane.endpoints().list(), model, version, registry.client().alias_version)
    is_llm = quantized_checkpoint["is_llm"]
    runtimes = {}
    for spec in specs or []:
        runtimes.setdefault(choose_runtime(spec.runtime, is_llm), spec.replica.model_dump())
    if not runtimes:
        runtimes[choose_runtime(Runtime.auto, is_llm)] = {}
    checkpoint = serving_checkpoint(quantized_checkpoint)
    client = images.client()
    work = Path(images.work_dir)
    built, metadata = {}, {"mode": "lazy", "checkpoint": checkpoint.label}
    try:
        for runtime, replica_config in sorted(runtimes.items()):
            ref, facts = build_serving_image(
                client, repository_name(images.repo_prefix, model), f"v{version}-{runtime}", Path(checkpoint.model_dir),
                runtime, replica_config, work / "builds" / f"{model}-v{version}-{runtime}", images.layer_cache(),
                images.settings(), context.log.info,
                labels={"org.modelplane.model": model, "org.modelplane.version": version,
                        "org.modelplane.checkpoint": checkpoint.label})
            built[runtime] = ref.to_json()
            context.log.info(f"{runtime} image {ref.reference}: {facts['image_bytes'] / 1e9:.2f} GB, "
                             f"built in {facts['build_s']} s")
            metadata |= {
                f"{runtime}_image": ref.reference,
                f"{runtime}_digest": ref.manifest_digest,
                f"{runtime}_seekable_digest": ref.seekable_digest,
                f"{runtime}_registry": MetadataValue.url(f"{ref.registry}/v2/{ref.repo}/manifests/{ref.tag}"),
                f"{runtime}_digest_url": MetadataValue.url(image_digest_url(ref.registry, ref.repo, ref.manifest_digest)),
                f"{runtime}_seekable_url": MetadataValue.url(image_digest_url(ref.registry, ref.repo,
                                                                              ref.seekable_digest)),
                f"{runtime}_layers_table": MetadataValue.md(image_layers_table(facts["layers"])),
                f"{runtime}_image_bytes": facts["image_bytes"],
                f"{runtime}_seekable_bytes": facts["seekable_bytes"],
                f"{runtime}_build_s": facts["build_s"],
                f"{runtime}_layers": MetadataValue.json(facts["layers"]),
                f"{runtime}_traced_files": MetadataValue.json(facts["traced_files"]),
                f"{runtime}_trace": facts["trace"],  # "recorded", "cache" (images.trace_cache) or "off"
            }
    finally:
        client.close()
    return Output({"mode": "lazy", "images": built}, metadata=metadata)
