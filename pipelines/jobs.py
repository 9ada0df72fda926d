"""The deploy job: every asset of the ``deploy`` group, for one model-version partition.

The jobs run their steps in the run's own process (``in_process_executor``), one after the
other: the deploy steps form one chain (each needs the one before), so a process per step
would run nothing side by side and would only add a Python start-up and a code-location load
to every step (about 3 s each, 20-25 s a deploy on 2 cores). The steps that measure or load
models start processes of their own anyway (the quantizer through Dagster Pipes, the engine
for the gate and the sweep, the replicas); the ``modelplane-measurement`` pool still holds
across runs (Dagster enforces pools in both executors).
"""

from dagster import AssetSelection, define_asset_job, in_process_executor

from assets.source_model import model_versions

deploy_job = define_asset_job(
    name="deploy",
    selection=AssetSelection.groups("deploy"),
    partitions_def=model_versions,
    executor_def=in_process_executor,
    description="Take one registered model version from the registry to a served endpoint.",
)

cost_model_job = define_asset_job(
    name="remeasure_cost",
    selection=AssetSelection.assets("cost_model"),
    partitions_def=model_versions,
    executor_def=in_process_executor,
    description="Measure a deployed version's cost model again (a missing hardware profile, or drift).",
)
