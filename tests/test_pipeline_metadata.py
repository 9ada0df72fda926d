"""What the deploy steps show: the pure table, plot and link builders, the MLflow version tags, the
catalog's shape, and the serving tags written from the revision store (docs/pipeline-metadata.md)."""

import io
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from PIL import Image

from assets.metadata import (cost_levels_table, endpoints_table, gate_checks_table, image_layers_table, is_png,
                             layer_group_table, markdown_table, mlflow_run_url, mlflow_version_url, mlflow_web,
                             png_markdown, png_of, quantization_sizes_table, scores_table, sweep_table, table_rows,
                             worst_examples_table, worst_layers_table)
from assets.scaling_plot import replica_steps, replicas_vs_demand_png
from controlplane.scaling import ScalingStore
from pipelines import version_tags as tags
from quantization.reconstruction import layer_group

DOC = Path(__file__).resolve().parent.parent / "docs" / "pipeline-metadata.md"


def png_size(data: bytes) -> tuple[int, int]:
    assert is_png(data)
    with Image.open(io.BytesIO(data)) as image:
        image.load()  # decodes every row: a truncated PNG raises here
        return image.size


# ---- tables ----------------------------------------------------------------------------------

@pytest.mark.parametrize("headers, rows", [
    (["a"], []),
    (["a", "b"], [[1, 2.5], ["x | y", "line\nbreak"]]),
    (["metric", "value"], [["nan", float("nan")], [None, 1e-9]]),
])
def test_a_table_has_a_header_a_rule_and_one_line_per_row_that_reads_back(headers, rows):
    markdown = markdown_table(headers, rows)
    lines = markdown.splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[1] == "|" + "---|" * len(headers)
    read = table_rows(markdown)
    assert [list(r) for r in read] == [headers] * len(rows)
    assert all(len(re.split(r"(?<!\\)\|", line)) == len(headers) + 2 for line in lines)


def test_a_row_with_the_wrong_number_of_cells_is_refused():
    with pytest.raises(ValueError, match="2 cells under 3 headers"):
        markdown_table(["a", "b", "c"], [[1, 2]])


def test_the_gate_table_shows_each_check_its_bound_and_the_paired_interval():
    rows = table_rows(gate_checks_table([
        {"name": "exact_match vs baseline", "reference": 0.41, "candidate": 0.40, "measured": 0.01, "bound": 0.05,
         "passed": True, "spec_field": "eval_gate.max_regression",
         "paired": {"interval": [-0.03, 0.05], "confidence": 0.95, "p_value": 0.31}},
        {"name": "NLL vs baseline", "reference": 2.0, "candidate": 2.1, "measured": 0.05, "bound": 0.02,
         "passed": False, "spec_field": "eval_gate.max_nll_increase"}]))
    assert [r["check"] for r in rows] == ["exact_match vs baseline", "NLL vs baseline"]
    assert rows[0]["interval of the drop"] == "95%: -0.030 to 0.050" and rows[0]["p"] == "0.31"
    assert rows[1]["result"] == "❌ failed" and rows[1]["set by"] == "eval_gate.max_nll_increase"


def test_the_worst_examples_table_lists_them_in_order_or_says_there_are_none():
    assert "none" in worst_examples_table([])
    rows = table_rows(worst_examples_table([
        {"id": "e7", "input": "she go", "reference": "She goes.", "baseline": "She goes.", "candidate": "She go.",
         "baseline_similarity": 1.0, "candidate_similarity": 0.8},
        {"id": "e2", "input": "a|b", "reference": "x", "baseline": "x", "candidate": "y",
         "baseline_similarity": 1.0, "candidate_similarity": 0.0}]))
    assert [r["id"] for r in rows] == ["e7", "e2"] and rows[1]["input"] == "a|b"


def test_scores_leave_out_a_checkpoint_that_was_not_evaluated():
    rows = table_rows(scores_table({"candidate": {"task": 0.4, "nll": 2.03}, "baseline": {"task": 0.41, "nll": 2.0},
                                    "serving": None}, "exact_match"))
    assert [r["checkpoint"] for r in rows] == ["candidate", "baseline"] and rows[0]["exact_match"] == "0.4"


def test_layer_groups_count_their_layers_and_name_the_worst():
    layers = {"model.layers.0.self_attn.q_proj": 0.010, "model.layers.1.self_attn.o_proj": 0.030,
              "model.layers.0.mlp.up_proj": 0.005, "model.layers.1.mlp.down_proj": 0.007}
    rows = table_rows(layer_group_table({"attention": 0.02, "mlp": 0.006}, layers, layer_group))
    assert rows == [
        {"layer group": "attention", "layers": "2", "weight error %": "2", "worst layer": "model.layers.1.self_attn.o_proj",
         "its error %": "3"},
        {"layer group": "mlp", "layers": "2", "weight error %": "0.6", "worst layer": "model.layers.1.mlp.down_proj",
         "its error %": "0.7"}]
    assert [r["layer"] for r in table_rows(worst_layers_table(layers, limit=2))] == [
        "model.layers.1.self_attn.o_proj", "model.layers.0.self_attn.q_proj"]
    [sizes] = table_rows(quantization_sizes_table({"size_before_bytes": 8e6, "size_after_bytes": 2e6,
                                                   "weight_error": {"quantized_layers": 4}, "quantize_s": 1.5}))
    assert sizes["after / before"] == "0.25"


def test_the_cost_table_has_one_row_per_concurrency_with_the_target_marked_and_units_that_add_up():
    levels = [{"concurrency": c, "alpha_ms_per_input_token": 0.1 * c, "beta_ms_per_output_token": 10.0 + c,
               "gamma_ms": 20.0} for c in (4, 1, 16)]
    rows = table_rows(cost_levels_table(levels, 4, (100, 10)))
    assert [r["concurrency"] for r in rows] == ["1", "4", "16"]
    assert [r["target"] for r in rows] == ["", "◀ target", ""]
    at4 = rows[1]
    assert float(at4["latency ms (100 in, 10 out)"]) == pytest.approx(0.4 * 100 + 14 * 10 + 20)
    assert float(at4["model units (100 in, 10 out)"]) == pytest.approx((0.4 * 100 + 14 * 10 + 20) / 4)


def test_the_sweep_table_is_ordered_by_shape_then_concurrency():
    points = [{"input_tokens": i, "output_tokens": 4, "concurrency": c, "n_ok": 5, "n_failed": 0,
               "p50_latency_ms": 10.0, "p99_latency_ms": 12.0, "throughput_rps": 3.0} for i in (64, 16) for c in (4, 1)]
    assert [(r["input"], r["concurrency"]) for r in table_rows(sweep_table(points))] == [
        ("16", "1"), ("16", "4"), ("64", "1"), ("64", "4")]


def test_the_endpoints_and_image_tables():
    [row] = table_rows(endpoints_table([{"endpoint": "gec", "revision": "gec-v3-ab", "previous_revision": None,
                                         "runtime": "vllm", "replicas": 2, "target_concurrency": 8,
                                         "url": "http://r/serving-endpoints/gec/invocations"}]))
    assert row["replaced"] == "" and row["URL"].endswith("/gec/invocations")
    rows = table_rows(image_layers_table({"env": {"digest": "sha256:e", "bytes": 3e8, "layer_s": 40.0, "seekable_s": 9.5},
                                          "model": {"digest": "sha256:m", "bytes": 2e6, "layer_s": 0.2,
                                                    "seekable_s": 0.1}}))
    assert [(r["layer"], r["MB"], r["seekable s"]) for r in rows] == [("env", "300", "9.5"), ("model", "2", "0.1")]


# ---- plots -----------------------------------------------------------------------------------

def test_a_png_embeds_as_markdown_and_reads_back_byte_for_byte():
    png = replicas_vs_demand_png([(3600.0, 1)], {}, now_s=7200.0)
    value = png_markdown(png, "a plot")
    assert value.value.startswith("![a plot](data:image/png;base64,")
    assert png_of(value.value) == png
    with pytest.raises(ValueError):
        png_markdown(b"GIF89a", "not a png")


def test_replicas_against_demand_is_a_png_of_the_documented_size_with_data_or_without():
    now_s = 1_800_000_000.0
    decisions = [(now_s - 30 * 3600, 1), (now_s - 20 * 3600, 3), (now_s - 2 * 3600, 2)]
    demand = {int(now_s // 60) - m: 5.0 + (m % 30) for m in range(0, 24 * 60, 7)}
    assert png_size(replicas_vs_demand_png(decisions, demand, now_s, target_concurrency=4)) == (640, 256)
    assert png_size(replicas_vs_demand_png([], {}, now_s)) == (640, 256)


def test_a_decision_before_the_window_sets_the_count_it_opens_with():
    hours, replicas = replica_steps([(100.0, 3), (7300.0, 1)], now_s=10900.0, window_s=7200.0, before=3)
    assert (hours, replicas) == ([-2.0, -1.0, 0.0], [3, 1, 1])


def test_the_cost_model_panels_are_pngs():
    from costmodel.fit import fit_cost_model
    from costmodel.plot import fit_png, latency_png
    from costmodel.sweep import RequestSample, SweepPoint

    samples = [RequestSample(i, o, c, 0.5 * i + 20 * o + 30 + 5 * c, None, True)
               for i in (16, 64) for o in (4, 16) for c in (1, 4) for _ in range(3)]
    points = [SweepPoint.aggregate([s for s in samples if (s.input_tokens, s.output_tokens, s.concurrency) == key], 1.0)
              for key in {(s.input_tokens, s.output_tokens, s.concurrency) for s in samples}]
    model = fit_cost_model(samples, points, 5000.0, None, "llm")
    assert png_size(latency_png(points, model)) == png_size(fit_png(samples, model)) == (360, 320)


# ---- links -----------------------------------------------------------------------------------

@pytest.mark.parametrize("tracking, ui, web", [
    ("http://mlflow:5000/", None, "http://mlflow:5000"),
    ("sqlite:///mlflow.db", None, None),
    ("http://mlflow.modelplane.svc:5000", "https://mlflow.example.com/", "https://mlflow.example.com"),
])
def test_mlflow_links_go_to_the_ui_where_there_is_one(tracking, ui, web):
    assert mlflow_web(tracking, ui) == web
    assert mlflow_run_url(web, "r1") == (f"{web}/#/runs/r1" if web else None)
    assert mlflow_version_url(web, "gec", "3") == (f"{web}/#/models/gec/versions/3" if web else None)


# ---- MLflow version tags ---------------------------------------------------------------------

def test_every_tag_is_documented_in_one_table():
    documented = set(re.findall(r"^\| `(modelplane\.[a-z_.]+)` \|", DOC.read_text(), re.MULTILINE))
    assert documented == set(tags.ALL_TAGS)


def test_serving_tags_clear_the_reason_and_not_serving_clears_the_place():
    serving = tags.serving_tags([
        {"endpoint": "b", "revision": "b-v3-2", "url": "http://r/b", "checkpoint": "int8", "since": "2026-12-02T00:00:00+00:00"},
        {"endpoint": "a", "revision": "a-v3-1", "url": "http://r/a", "checkpoint": "int8", "since": "2026-12-01T00:00:00+00:00"}],
        "unused")
    assert serving[tags.SERVING_ENDPOINT] == "a, b" and serving[tags.SERVING_SINCE] == "2026-12-01T00:00:00+00:00"
    assert serving[tags.SERVING_REASON] is None
    gone = tags.serving_tags([], "replaced by gec.v4 on gec")
    assert gone[tags.SERVING_STATE] == "not serving" and gone[tags.SERVING_REASON] == "replaced by gec.v4 on gec"
    assert all(gone[key] is None for key in (tags.SERVING_ENDPOINT, tags.SERVING_SINCE, tags.SERVING_URL))
    assert set(serving) == set(gone)  # each state sets or deletes every serving tag


def test_gate_tags_name_a_known_result_and_keep_long_reasons_short():
    refused = tags.gate_tags("refused", "refused; nothing is served", "exact_match vs baseline: drop 0.2", ["x" * 5000])
    assert refused[tags.GATE_RESULT] == "refused" and len(refused[tags.GATE_REASONS]) == tags.MAX_VALUE_CHARS
    assert tags.gate_tags("passed", "passed")[tags.GATE_REASONS] is None
    with pytest.raises(ValueError, match="gate result"):
        tags.gate_tags("maybe", "?")


def test_cost_tags_are_the_target_levels_coefficients():
    model = {"target_concurrency": 4, "slo_met": False, "levels": [
        {"concurrency": 1, "alpha_ms_per_input_token": 0.1, "beta_ms_per_output_token": 9.0, "gamma_ms": 10.0},
        {"concurrency": 4, "alpha_ms_per_input_token": 0.25, "beta_ms_per_output_token": 21.5, "gamma_ms": 33.0}]}
    assert tags.cost_tags(model, "cpu/x") == {
        tags.COST_ALPHA: "0.25", tags.COST_BETA: "21.5", tags.COST_GAMMA: "33", tags.COST_TARGET: "4",
        tags.COST_HARDWARE: "cpu/x", tags.COST_SLO_MET: "false"}


# ---- the catalog -----------------------------------------------------------------------------

def test_every_asset_and_check_reads_well_in_the_catalog():
    from assets.catalog import OWNERS
    from pipelines.definitions import defs

    graph = defs.resolve_asset_graph()
    steps = []
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.description and len(node.description) > 60, key
        assert node.group_name == "deploy" and list(node.owners) == OWNERS, key
        assert node.kinds, key
        steps.append(node.tags["modelplane/step"])
    assert sorted(steps) == ["1-source", "2-quantize", "3-measure", "4-build", "5-serve"]
    for check_key in graph.asset_check_keys:
        assert graph.get_check_spec(check_key).description, check_key


# ---- serving tags from the revision store ----------------------------------------------------

def test_a_replaced_version_says_by_what_and_when_and_the_new_one_where_and_since(sqlite_url):
    from assets.served_endpoint import _record_replaced
    from assets.serving_state import record_serving
    from controlplane import db
    from controlplane.revisions import RevisionStore
    from pipelines.registry import InMemoryRegistry

    db.upgrade(sqlite_url)
    revisions = RevisionStore(db.make_engine(sqlite_url))
    registry = InMemoryRegistry()
    for _ in range(2):
        registry.register("gec")
    old = revisions.create("gec", "gec.v1", "/m/1", "pyfunc", {}, 1, {"checkpoint": "as registered"})
    revisions.route("gec", old.id)
    revisions.add_details(old.id, routed_at="2026-12-01T10:00:00+00:00")
    record_serving(registry, revisions, "http://router", "gec.v1", "unused")
    assert registry.model_version("gec", "1").tags[tags.SERVING_STATE] == "serving"

    new = revisions.create("gec", "gec.v2", "/m/2", "pyfunc", {}, 1, {"checkpoint": "as registered"})
    revisions.route("gec", new.id, old.id)
    revisions.add_details(new.id, routed_at="2026-12-01T11:00:00+00:00")
    record_serving(registry, revisions, "http://router", "gec.v2", "unused")
    _record_replaced(registry, revisions, "http://router", "gec.v2",
                     [{"endpoint": "gec", "revision": new.id, "previous_revision": old.id}])

    v1, v2 = registry.model_version("gec", "1").tags, registry.model_version("gec", "2").tags
    assert v1[tags.SERVING_STATE] == "not serving" and tags.SERVING_ENDPOINT not in v1
    assert v1[tags.SERVING_REASON] == "replaced by gec.v2 on gec at 2026-12-01T11:00:00+00:00"
    assert v2[tags.SERVING_STATE] == "serving" and tags.SERVING_REASON not in v2
    assert (v2[tags.SERVING_ENDPOINT], v2[tags.SERVING_URL], v2[tags.SERVING_SINCE]) == (
        "gec", "http://router/serving-endpoints/gec/invocations", "2026-12-01T11:00:00+00:00")
    since = datetime.fromisoformat(v2[tags.SERVING_SINCE])
    assert since - datetime(2026, 12, 1, tzinfo=timezone.utc) == timedelta(hours=11)


def test_the_health_check_carries_the_last_day_once_an_hour(sqlite_url):
    from dagster import DagsterInstance, build_sensor_context

    from controlplane import db
    from controlplane.revisions import RevisionStore
    from controlplane.specs import parse_spec
    from controlplane.store import EndpointStore
    from pipelines.health import endpoint_health_sensor
    from pipelines.resources import ClusterResource, ControlPlaneResource

    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    EndpointStore(engine).put(parse_spec("name: gec\nmodel: models:/gec@champion\n"))
    revisions = RevisionStore(engine)
    revision = revisions.create("gec", "gec.v1", "/m/1", "pyfunc", {}, 1, {"target_concurrency": 4})
    revisions.route("gec", revision.id)
    now = datetime.now(timezone.utc)
    ScalingStore(engine, now=lambda: now - timedelta(hours=2)).record(
        "gec", revision.id, "horizontal", rule="test", reason="test", inputs={}, replicas=2)
    resources = {"control_plane": ControlPlaneResource(database_url=sqlite_url),
                 "cluster": ClusterResource(database_url=sqlite_url)}
    instance = DagsterInstance.ephemeral()

    first = endpoint_health_sensor(build_sensor_context(instance=instance, resources=resources))
    [check] = first.asset_events
    assert png_size(png_of(check.metadata["replicas_vs_demand"].value)) == (640, 256)
    assert table_rows(check.metadata["health"].value)[2]["measure"] == "ready replicas"
    again = endpoint_health_sensor(build_sensor_context(instance=instance, resources=resources, cursor=first.cursor))
    assert "replicas_vs_demand" not in again.asset_events[0].metadata  # within the hour
