"""Fuzzing the parsers that take input from outside: whatever arrives, each answers with its own
error type (a 4xx with a message) or a value, never another exception.

- the endpoint-spec loader (CLI, admin API): ``SpecError`` naming the field;
- the MLflow webhook receiver: ``WebhookRejected`` with 400/401;
- the ``/invocations`` payload parser of the pyfunc server: ``InvocationError`` with a 4xx.
"""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.specs import EndpointSpec, SpecError, parse_spec
from controlplane.webhooks import RegistryEvent, WebhookRejected, parse_event, sign, verify
from serving.runtime.pyfunc.payload import INPUT_KEYS, InvocationError, parse_invocation

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                      max_size=4), max_leaves=25)
SPEC_KEYS = sorted(EndpointSpec.model_fields)


def expect_spec_or_error(text: str) -> None:
    try:
        assert isinstance(parse_spec(text), EndpointSpec)
    except SpecError as exc:
        assert str(exc).strip(), "a SpecError must say what is wrong"


@FUZZ
@given(st.text(max_size=3000))
def test_any_text_is_a_spec_or_a_spec_error(text):
    expect_spec_or_error(text)


@FUZZ
@given(st.dictionaries(st.sampled_from(SPEC_KEYS) | st.text(max_size=8), JSON, max_size=8))
def test_any_mapping_of_spec_fields_is_a_spec_or_a_spec_error(document):
    expect_spec_or_error(json.dumps(document))
    expect_spec_or_error(yaml.safe_dump(document))


def test_hostile_yaml_is_a_spec_error():
    billion_laughs = "a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\nd: &d [*c, *c]\ne: [*d, *d]\n"
    for text in ("[" * 100_000, billion_laughs, "!!python/object/apply:os.system ['true']", "name: a\nname: b\n",
                 "\x00\x01", "name: x\n" + "#" * 2_000_000):
        expect_spec_or_error(text)


def expect_event_or_rejection(body: bytes) -> None:
    try:
        event = parse_event("delivery-1", body)
        assert isinstance(event.registered_model, str) and event.registered_model
    except WebhookRejected as exc:
        assert exc.status == 400 and str(exc).strip()


@FUZZ
@given(st.binary(max_size=2000))
def test_any_webhook_body_is_an_event_or_a_400(body):
    expect_event_or_rejection(body)


@FUZZ
@given(st.fixed_dictionaries({}, optional={"entity": JSON, "action": JSON, "data": JSON}))
def test_any_json_webhook_body_is_an_event_or_a_400(payload):
    expect_event_or_rejection(json.dumps(payload).encode())


def test_a_deeply_nested_webhook_body_is_a_400_not_a_crash():
    for body in (b"[" * 200_000, b'{"data":' * 50_000):
        expect_event_or_rejection(body)


@FUZZ
@given(st.text(max_size=70) | st.none(), st.text(max_size=20) | st.none(), st.text(max_size=80) | st.none(),
       st.binary(max_size=200))
def test_any_webhook_headers_are_checked_before_the_body_is_read(delivery_id, timestamp, signature, body):
    try:
        verify(secret="s3cret", delivery_id=delivery_id, timestamp=timestamp, signature=signature, body=body,
               now_s=1_800_000_000.0)
        raise AssertionError("an unsigned delivery was accepted")
    except WebhookRejected as exc:
        assert exc.status == 401 and str(exc).strip()


@FUZZ
@given(st.binary(max_size=500))
def test_a_correctly_signed_body_of_any_bytes_is_an_event_or_a_400(body):
    timestamp = "1800000000"
    try:
        event = verify(secret="s3cret", delivery_id="d-1", timestamp=timestamp,
                       signature=sign("s3cret", "d-1", timestamp, body), body=body, now_s=1_800_000_000.0)
        assert isinstance(event, RegistryEvent)
    except WebhookRejected as exc:
        assert exc.status == 400


def expect_invocation_or_4xx(body: bytes) -> None:
    try:
        invocation = parse_invocation(body)
        assert invocation.row_count >= 1
    except InvocationError as exc:
        assert 400 <= exc.status < 500 and exc.message.strip()


@FUZZ
@given(st.binary(max_size=2000))
def test_any_invocation_body_is_parsed_or_a_4xx(body):
    expect_invocation_or_4xx(body)


@FUZZ
@given(st.sampled_from(INPUT_KEYS), JSON, st.none() | JSON)
def test_any_value_under_an_input_key_is_parsed_or_a_4xx(key, value, params):
    document = {key: value} if params is None else {key: value, "params": params}
    expect_invocation_or_4xx(json.dumps(document).encode())


def test_a_model_name_that_could_be_a_path_or_hide_a_character_is_refused_before_it_is_stored():
    for name in ("../../etc/passwd", "/abs/model", "gec/../x", "a\x00b", "line\nbreak", ".hidden", "x" * 300, ""):
        body = json.dumps({"entity": "model_version", "action": "created", "data": {"name": name, "version": "1"}})
        try:
            parse_event("d-1", body.encode())
            raise AssertionError(f"{name!r} was accepted")
        except WebhookRejected as exc:
            assert exc.status == 400 and "data.name" in str(exc)
    assert parse_event("d-1", b'{"entity":"model_version","action":"created","data":{"name":"gec.v2-int8","version":3}}'
                       ).registered_model == "gec.v2-int8"


@pytest.mark.parametrize("spec", [
    "name: ../x\nmodel: models:/a@champion\n",
    "name: 'a\\x00b'\nmodel: models:/a@champion\n",
    "name: ok\nmodel: models:/../a@champion\n",
    "name: ok\nmodel: models:/a@../champion\n",
    "name: ok\nmodel: models:/%2e%2e@champion\n",
    "name: ok\nmodel: /etc/passwd\n",
    "name: ok\nmodel: file:///etc/passwd\n",
    "name: ok\nmodel: \"models:/a\\nb@champion\"\n",
])
def test_an_endpoint_or_model_name_that_could_be_a_path_is_refused_by_the_spec_loader(spec):
    with pytest.raises(SpecError):
        parse_spec(spec)


@pytest.mark.parametrize("model_binary", ["../outside", "/etc", "model/../../outside", "line\nbreak", 7, "link"])
def test_a_model_whose_files_point_outside_its_directory_is_refused_before_they_are_read(tmp_path, model_binary):
    from serving.runtime.model_layout import ModelLayoutError, locate

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text('{"max_position_embeddings": 8}')
    (outside / "tokenizer.json").write_text("{}")
    model_dir = tmp_path / "model-dir"
    model_dir.mkdir()
    (model_dir / "link").symlink_to(outside)
    (model_dir / "MLmodel").write_text(yaml.safe_dump({"flavors": {"transformers": {"model_binary": model_binary}}}))
    with pytest.raises(ModelLayoutError, match="not a folder inside the model directory"):
        locate(model_dir)
