"""The deploy job on the tiny Llama shows each step's tables, plots and links in Dagster, and writes the
version's state on its MLflow page (docs/pipeline-metadata.md).

Real parts, as in tests/test_deploy_gate.py: MLflow on SQLite, the quantization environment
through Dagster Pipes, vLLM for the gate, the supervisor's replicas for the cost sweep and the
endpoint. The endpoint's last day of autoscaler decisions is recorded first, as a redeploy finds
it, so ``served_endpoint`` has a replicas-against-demand plot to draw. A second version whose
quantized scales were damaged is refused by the gate: its page says why it does not serve, and
the first version's still says where it does.
"""

import io
import time
from datetime import datetime, timedelta, timezone

import pytest
from PIL import Image

from assets.metadata import png_of, table_rows
from controlplane.scaling import ScalingStore
from pipelines import version_tags as tags
from tests.test_deploy_gate import REPO, Deployment

pytestmark = pytest.mark.slow
UI = "http://mlflow.example:5000"
STEPS = ("source_model", "quantized_checkpoint", "cost_model", "serving_image", "served_endpoint")


def decoded_png(markdown: str) -> tuple[int, int]:
    with Image.open(io.BytesIO(png_of(markdown))) as image:
        image.load()
        return image.size


def record_last_day(engine, endpoint: str, now: datetime) -> None:
    """What an autoscaler would have left: a few replica decisions and a peak in flight per minute."""
    for hours_ago, replicas in ((20, 1), (8, 2), (1, 1)):
        at = now - timedelta(hours=hours_ago)
        ScalingStore(engine, now=lambda at=at: at).record(endpoint, f"{endpoint}-v0-old", "horizontal",
                                                          rule="test", reason="recorded by the test", inputs={},
                                                          replicas=replicas)
    now_minute = int(now.timestamp() // 60)
    for minutes_ago in range(0, 24 * 60, 10):
        ScalingStore(engine).save_demand(endpoint, now_minute - minutes_ago, 1.0 + (minutes_ago // 60) % 5)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    from demo.tiny_llama import build_tiny_llama

    root = tmp_path_factory.mktemp("deploy-metadata")
    deployment = Deployment(root)
    deployment.mlflow_ui_url = UI
    deployment.checkpoint = build_tiny_llama(root / "tiny")
    record_last_day(deployment.engine, "tiny", datetime.now(timezone.utc))
    try:
        version = deployment.register(deployment.checkpoint)
        started = time.monotonic()
        result = deployment.deploy(version)
        print(f"deploy of tiny-llm v{version}: {time.monotonic() - started:.0f} s")
        assert result.success, [e.message for e in result.all_events if e.is_failure]
        yield deployment, version, result
    finally:
        deployment.close()


def metadata_of(result) -> dict:
    return {step: {k: v.value for k, v in result.asset_materializations_for_node(step)[0].metadata.items()}
            for step in STEPS}


def test_each_step_shows_its_tables_plots_and_links(deployed):
    deployment, version, result = deployed
    meta = metadata_of(result)
    [gate] = result.get_asset_check_evaluations()
    gate = {k: v.value for k, v in gate.metadata.items()}

    source = meta["source_model"]
    [summary] = table_rows(source["summary"])
    assert (summary["flavor"], summary["kind"]) == ("transformers", "llm")
    assert source["mlflow_version"] == f"{UI}/#/models/tiny-llm/versions/{version}"

    quantized = meta["quantized_checkpoint"]
    groups = {row["layer group"]: row for row in table_rows(quantized["weight_error_by_group"])}
    assert set(groups) == {"attention", "mlp"}
    assert all(int(row["layers"]) > 0 and float(row["weight error %"]) > 0 for row in groups.values())
    assert 0 < len(table_rows(quantized["worst_layers"])) <= 10
    assert table_rows(quantized["sizes"])[0]["quantized layers"] == str(sum(int(r["layers"]) for r in groups.values()))
    assert quantized["mlflow_run"] == f"{UI}/#/runs/{quantized['mlflow_run_id']}"

    checks = {row["check"]: row for row in table_rows(gate["checks_table"])}
    assert {"exact_match vs baseline", "NLL vs baseline", "agreement with baseline"} <= set(checks)
    assert checks["exact_match vs baseline"]["interval of the drop"].startswith("95%: ")
    assert [row["checkpoint"] for row in table_rows(gate["scores"])] == ["candidate", "baseline"]
    assert "worst_examples" in gate

    cost = meta["cost_model"]
    levels = table_rows(cost["coefficients"])
    assert [row["concurrency"] for row in levels] == ["1", "4"]
    assert [row["concurrency"] for row in levels if row["target"]] == [str(cost["target_concurrency"])]
    assert len(table_rows(cost["sweep"])) == 8  # 2 input lengths × 2 output lengths × 2 concurrencies
    assert decoded_png(cost["latency_plot"]) == decoded_png(cost["fit_plot"]) == (360, 320)
    assert cost["mlflow_run"] == f"{UI}/#/runs/{cost['mlflow_run_id']}"

    assert meta["serving_image"]["mode"] == "off"  # started in place here; test_serving_image builds images

    served = meta["served_endpoint"]
    assert served["url"].endswith("/serving-endpoints/tiny/invocations")
    [endpoint] = table_rows(served["endpoints_table"])
    assert (endpoint["endpoint"], endpoint["revision"]) == ("tiny", served["revision"])
    assert decoded_png(served["replicas_vs_demand"]) == (640, 256)
    assert served["mlflow_version"] == source["mlflow_version"]


def test_the_version_page_says_it_serves_where_since_and_at_what_cost(deployed):
    deployment, version, result = deployed
    mv = deployment.mlflow.get_model_version("tiny-llm", version)
    page = mv.tags
    assert page[tags.QUANTIZATION_SCHEME] == "int8-w8a8-channel"
    assert page[tags.GATE_RESULT] == "passed"
    assert page[tags.GATE_INTERVAL].startswith("exact_match vs baseline: drop ")
    assert tags.GATE_REASONS not in page
    cost = result.asset_materializations_for_node("cost_model")[0].metadata
    assert int(page[tags.COST_TARGET]) == cost["target_concurrency"].value
    assert float(page[tags.COST_BETA]) == pytest.approx(cost["beta_ms_per_output_token"].value, rel=1e-2)
    assert float(page[tags.COST_ALPHA]) >= 0 and float(page[tags.COST_GAMMA]) >= 0
    assert page[tags.SERVING_STATE] == "serving" and tags.SERVING_REASON not in page
    assert page[tags.SERVING_ENDPOINT] == "tiny"
    assert page[tags.SERVING_REVISION] == deployment.serving_revision().id
    since = datetime.fromisoformat(page[tags.SERVING_SINCE])
    assert timedelta(0) <= datetime.now(timezone.utc) - since < timedelta(hours=1)


def test_a_refused_version_says_why_it_does_not_serve_and_the_serving_one_still_serves(deployed):
    deployment, first, _ = deployed
    second = deployment.register(deployment.checkpoint)
    result = deployment.deploy(second, worker=REPO / "tests" / "damaging_quantizer.py")
    assert not result.success

    refused = deployment.mlflow.get_model_version("tiny-llm", second).tags
    assert refused[tags.GATE_RESULT] == "refused"
    assert "eval_gate.max_nll_increase" in refused[tags.GATE_REASONS] or \
        "eval_gate.min_agreement" in refused[tags.GATE_REASONS]
    assert refused[tags.SERVING_STATE] == "not serving"
    assert refused[tags.SERVING_REASON].startswith("the eval gate refused int8-w8a8-channel: ")
    assert tags.SERVING_ENDPOINT not in refused
    still = deployment.mlflow.get_model_version("tiny-llm", first).tags
    assert (still[tags.SERVING_STATE], still[tags.SERVING_ENDPOINT]) == ("serving", "tiny")
