"""The deploy job: every asset of the ``deploy`` group, for one model-version partition."""

from dagster import AssetSelection, define_asset_job

from assets.source_model import model_versions

deploy_job = define_asset_job(
    name="deploy",
    selection=AssetSelection.groups("deploy"),
    partitions_def=model_versions,
    description="Take one registered model version from the registry to a served endpoint.",
)

cost_model_job = define_asset_job(
    name="remeasure_cost",
    selection=AssetSelection.assets("cost_model"),
    partitions_def=model_versions,
    description="Measure a deployed version's cost model again (a missing hardware profile, or drift).",
)
