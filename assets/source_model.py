"""``source_model``: the registered version, downloaded and described.

The first step of every deploy. Partition ``gec.v3`` resolves version 3 of registered
model ``gec`` in MLflow, downloads its artifacts under the model store, and records its
flavor, parameter count, signature and size as materialization metadata.
"""


import time

from dagster import (AssetExecutionContext, Backoff, DynamicPartitionsDefinition, Failure, MetadataValue, Output,
                     RetryPolicy, asset)

from assets.catalog import GROUP, OWNERS, step_tags
from assets.metadata import links, markdown_table, mlflow_run_url, mlflow_version_url
from assets.model_files import describe
from pipelines.registry import parse_partition_key
from pipelines.resources import ModelStoreResource, RegistryResource

#: One partition per registered model version, keyed "<model>.v<version>".
model_versions = DynamicPartitionsDefinition(name="model_versions")
#: Deploy steps retry transient failures (the registry unreachable, a replica that did not come
#: up) within the run, 10 s then 20 s later; a ``Failure(allow_retries=False)`` is a decision.
DEPLOY_RETRIES = RetryPolicy(max_retries=2, delay=10, backoff=Backoff.EXPONENTIAL)


@asset(
    partitions_def=model_versions,
    group_name=GROUP,
    kinds={"mlflow"},
    owners=OWNERS,
    tags=step_tags(1, "source"),
    description="Step 1 of 5. The registered model version, downloaded from MLflow and described: flavor, "
                "parameter count, signature, size, with links to its MLflow version page and run.",
    retry_policy=DEPLOY_RETRIES,
)
def source_model(
    context: AssetExecutionContext, registry: RegistryResource, model_store: ModelStoreResource
) -> Output[dict]:
    model, version = parse_partition_key(context.partition_key)
    client = registry.client()
    try:
        registered = client.model_version(model, version)
    except KeyError as exc:  # the registry answered: no such version, and waiting will not make one
        raise Failure(description=f"{exc.args[0]} in the MLflow registry; nothing to deploy",
                      allow_retries=False) from None
    started = time.monotonic()
    local_dir = client.download(model, version, model_store.version_dir(model, version, "source"))
    download_s = time.monotonic() - started
    described = describe(local_dir)
    context.log.info(
        f"{model} v{version}: {described.flavor}, {described.size_bytes / 1e6:.1f} MB, "
        f"{described.parameter_count or 'unknown'} parameters"
    )
    value = {
        "model": model,
        "version": version,
        "local_dir": str(local_dir),
        "source": registered.source,
        "run_id": registered.run_id,
        "flavor": described.flavor,
        "is_llm": described.is_llm,
        "parameter_count": described.parameter_count,
        "signature": described.signature,
        "size_bytes": described.size_bytes,
    }
    metadata = {
        "model": model,
        "version": version,
        "source": registered.source,
        "run_id": registered.run_id or "",
        "flavor": described.flavor,
        "flavors": ", ".join(described.flavors),
        "kind": "llm" if described.is_llm else "classic",
        "parameter_count": described.parameter_count if described.parameter_count is not None else -1,
        "size_bytes": described.size_bytes,
        "size_mb": round(described.size_bytes / 1e6, 2),
        "file_count": described.file_count,
        "download_s": round(download_s, 2),
        "local_dir": MetadataValue.path(str(local_dir)),
        "signature": MetadataValue.json(described.signature or {}),
        "summary": MetadataValue.md(markdown_table(
            ["model", "version", "flavor", "kind", "parameters", "size MB", "files"],
            [[model, version, described.flavor, "llm" if described.is_llm else "classic",
              described.parameter_count if described.parameter_count is not None else "unknown",
              round(described.size_bytes / 1e6, 2), described.file_count]])),
        **links(mlflow_version=mlflow_version_url(registry.web_url(), model, version),
                mlflow_run=mlflow_run_url(registry.web_url(), registered.run_id)),
    }
    return Output(value, metadata=metadata)
