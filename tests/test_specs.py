"""Endpoint specs: what is accepted, what is refused, and how the refusal reads."""

import json
from pathlib import Path

import pytest

from controlplane.specs import EndpointSpec, SpecError, json_schema, load_spec, parse_spec

REPO = Path(__file__).resolve().parent.parent
MINIMAL = "name: gec\nmodel: models:/gec@champion\n"


@pytest.mark.parametrize("example", sorted((REPO / "examples" / "endpoints").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_examples_parse(example: Path):
    spec = load_spec(example)
    assert spec.name == example.stem
    assert spec.alias == "champion"


def test_minimal_spec_takes_the_documented_defaults():
    spec = parse_spec(MINIMAL)
    assert spec == EndpointSpec(name="gec", model="models:/gec@champion")
    assert (spec.registered_model, spec.alias) == ("gec", "champion")
    assert spec.quantization.weight_granularity.value == "channel"
    assert spec.quantization.kv_cache is False
    assert spec.scaling.min_replicas <= spec.scaling.max_replicas


@pytest.mark.parametrize(
    "extra_yaml, field, words",
    [
        ("colour: blue\n", "colour", "unknown field"),
        ("scaling: {max_replicsa: 3}\n", "scaling.max_replicsa", "unknown field"),
        ("scaling: {min_replicas: many}\n", "scaling.min_replicas", "valid integer"),
        ("scaling: {min_replicas: -1}\n", "scaling.min_replicas", "greater than or equal to 0"),
        ("slo: {p99_latency_ms: -5}\n", "slo.p99_latency_ms", "greater than 0"),
        ("scaling: {min_replicas: 5, max_replicas: 2}\n", "scaling", "min_replicas (5) must not exceed max_replicas (2)"),
        ("quantization: {scheme: fp4}\n", "quantization.scheme", "'auto', 'fp8', 'int8' or 'none'"),
        ("eval_gate: {max_regression: 2}\n", "eval_gate.max_regression", "less than or equal to 1"),
        ("eval_gate: {dataset: squad}\n", "eval_gate.dataset", "unknown evaluation set 'squad'; known: gec-dev"),
        ("eval_gate: {metric: bleu}\n", "eval_gate.metric", "'exact_match' or 'similarity'"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(extra_yaml: str, field: str, words: str):
    with pytest.raises(SpecError) as refused:
        parse_spec(MINIMAL + extra_yaml)
    assert f"{field}: " in str(refused.value)
    assert words in str(refused.value)


@pytest.mark.parametrize(
    "model, words",
    [("models:/gec", "models:/<registered model>@<alias>"), ("runs:/abc/model", "@<alias>"), ("models:/gec/3", "@<alias>")],
)
def test_model_uri_must_name_an_alias(model: str, words: str):
    with pytest.raises(SpecError, match="model: ") as refused:
        parse_spec(f"name: gec\nmodel: {model}\n")
    assert words in str(refused.value)


@pytest.mark.parametrize("text, words", [("- a list\n", "must be a mapping"), ("name: [unclosed\n", "not valid YAML"),
                                         ("name: Not_A_DNS_Label\nmodel: models:/g@a\n", "name: ")])
def test_malformed_documents_are_refused(text: str, words: str):
    with pytest.raises(SpecError, match=words):
        parse_spec(text)


def test_oversized_spec_is_refused():
    with pytest.raises(SpecError, match="larger than"):
        parse_spec(MINIMAL + "# " + "x" * 70_000 + "\n")


def test_exported_json_schema_matches_the_code():
    exported = json.loads((REPO / "docs" / "endpoint-spec.schema.json").read_text())
    assert exported == json_schema(), "run `make schema` to regenerate docs/endpoint-spec.schema.json"


def test_replica_options_are_exactly_what_the_runtime_config_takes():
    from serving.runtime.base import RuntimeConfig

    options = parse_spec(MINIMAL + "replica: {api_server_count: 2, workers: 3}\n").replica.model_dump()
    config = RuntimeConfig(model_name="gec", **options)
    assert (config.api_server_count, config.workers, config.max_batch_size) == (2, 3, 64)
