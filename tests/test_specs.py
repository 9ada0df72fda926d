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
        ("eval_gate: {max_examples: 5}\n", "eval_gate.max_examples", "greater than or equal to 10"),
        ("slo: {p99_latency_ms: .inf}\n", "slo.p99_latency_ms", "finite number"),
        ("slo: {p99_latency_ms: .nan}\n", "slo.p99_latency_ms", "finite number"),
        ("eval_gate: {max_nll_increase: .inf}\n", "eval_gate.max_nll_increase", "finite number"),
        ("scaling: {max_replicas: 100000}\n", "scaling.max_replicas", "less than or equal to 256"),
        ("scaling: {min_replicas: 300, max_replicas: 300}\n", "scaling.min_replicas", "less than or equal to 256"),
        ("cost_model: {requests_per_point: 5000}\n", "cost_model.requests_per_point", "less than or equal to 1000"),
        ("cost_model: {input_tokens: [1, 2, 3, 4, 5, 6, 7, 8], output_tokens: [1, 2, 3, 4, 5, 6, 7, 8], "
         "max_point_s: 600}\n", "cost_model", "could take up to"),
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


def test_a_key_given_twice_is_refused_naming_it_and_its_line():
    with pytest.raises(SpecError, match="duplicate key 'scaling' on line 4"):
        parse_spec(MINIMAL + "scaling: {max_replicas: 2}\nscaling: {max_replicas: 8}\n")


def test_deeply_nested_yaml_is_refused_not_a_crash():
    with pytest.raises(SpecError, match="nested too deeply"):
        parse_spec(MINIMAL + "extra: " + "[" * 5000 + "]" * 5000 + "\n")


def test_a_stored_spec_that_no_longer_validates_is_reported_and_skipped(migrated_engine):
    from sqlalchemy import update

    from controlplane.schema import EndpointRow
    from controlplane.store import EndpointStore

    store = EndpointStore(migrated_engine)
    store.put(parse_spec(MINIMAL))
    store.put(parse_spec("name: iris\nmodel: models:/iris@champion\n"))
    with migrated_engine.begin() as connection:  # e.g. written by an older version with looser rules
        connection.execute(update(EndpointRow).where(EndpointRow.name == "iris").values(
            spec={"name": "iris", "model": "models:/iris@champion", "scaling": {"max_replicas": 10**6}}))
    assert [spec.name for spec in store.list()] == ["gec"]
    [(name, error)] = store.invalid()
    assert name == "iris" and "scaling.max_replicas" in error


def test_oversized_spec_is_refused():
    with pytest.raises(SpecError, match="larger than"):
        parse_spec(MINIMAL + "# " + "x" * 70_000 + "\n")


def test_exported_json_schema_matches_the_code():
    exported = json.loads((REPO / "docs" / "endpoint-spec.schema.json").read_text())
    assert exported == json_schema(), "run `make schema` to regenerate docs/endpoint-spec.schema.json"


def test_the_reference_page_is_generated_from_the_code_and_names_every_field():
    from controlplane.spec_reference import reference

    committed = (REPO / "docs" / "endpoint-spec.md").read_text()
    assert committed == reference(), "run `make schema` to regenerate docs/endpoint-spec.md"
    schema = json_schema()
    for name, field in schema["properties"].items():
        assert f"| `{name}` |" in committed
        section = schema["$defs"].get(field.get("$ref", "").rsplit("/", 1)[-1], {})
        for sub in section.get("properties", {}):
            assert f"| `{name}.{sub}` |" in committed


def test_replica_options_are_exactly_what_the_runtime_config_takes():
    from serving.runtime.base import RuntimeConfig

    options = parse_spec(MINIMAL + "replica: {api_server_count: 2, workers: 3}\n").replica.model_dump()
    config = RuntimeConfig(model_name="gec", **options)
    assert (config.api_server_count, config.workers, config.max_batch_size) == (2, 3, 64)
