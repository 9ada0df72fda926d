"""Router safety: a generation never runs twice, tenants cannot set what they must not, and every
malformed or oversized input or answer is a 4xx or 502/504 with a message, never a 500."""

from __future__ import annotations

import json

import pytest

from tests.fake_replicas import FakeReplica
from tests.test_router import (ADMIN_TOKEN, CHAT_BODY, GEC_TOKEN, IRIS_BODY, IRIS_TOKEN, auth, closed_port_url,
                               make_router, table_for)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.fixture
def gec(request):
    """Two gec replicas: the first with the behaviour the test names, the second healthy."""
    first = FakeReplica("gec-bad", behaviour=request.param).start()
    second = FakeReplica("gec-ok").start()
    yield first, second
    first.stop()
    second.stop()


# ---- a generation never runs twice ----------------------------------------------------------------

@pytest.mark.parametrize("gec, status, words", [
    ("close", 502, "closed the connection"),  # the request had reached it: retrying could run it twice
    ("stall", 504, "stopped answering"),
], indirect=["gec"])
def test_a_replica_that_got_the_request_and_failed_is_not_retried(gec, status, words):
    bad, good = gec
    with make_router(table_for([bad.url], []), request_timeout_s=1.0, connect_timeout_s=0.5) as client:
        response = client.post("/v1/chat/completions", json=CHAT_BODY, headers=auth(GEC_TOKEN))
    assert response.status_code == status and words in response.json()["error"]["message"]
    assert len(bad.requests) == 1


@pytest.mark.parametrize("gec", ["close", "stall"], indirect=True)
def test_a_failure_after_sending_never_moves_the_request_to_another_replica(gec):
    bad, good = gec
    with make_router(table_for([bad.url, good.url], []), request_timeout_s=1.0, connect_timeout_s=0.5) as client:
        # P2C splits ties at random: 16 requests miss the bad replica with probability 2^-16
        answers = [client.post("/v1/chat/completions", json=CHAT_BODY, headers=auth(GEC_TOKEN)) for _ in range(16)]
    failed = [a for a in answers if a.status_code != 200]
    assert failed and len(failed) == len(bad.requests)  # each one reached the bad replica, and only it
    assert len(good.requests) == 16 - len(failed)


@pytest.mark.parametrize("gec", ["die"], indirect=True)
def test_a_request_whose_replica_died_with_it_is_answered_by_another(gec):
    """The connection broke and the port now refuses: the process and the request's work are gone,
    so another replica runs it (once), and later requests are not sent to the dead one."""
    bad, good = gec
    with make_router(table_for([bad.url, good.url], [])) as client:
        answers = [client.post("/v1/chat/completions", json=CHAT_BODY, headers=auth(GEC_TOKEN)) for _ in range(16)]
    assert [a.status_code for a in answers] == [200] * 16
    assert len(bad.requests) == 1 and len(good.requests) == 16  # P2C's ties reach the dead one: 1 - 2^-16


def test_connection_refused_is_still_retried_on_another_replica():
    good = FakeReplica("gec-ok").start()
    try:
        with make_router(table_for([closed_port_url(), good.url], [])) as client:
            answers = [client.post("/v1/completions", json={"model": "gec", "prompt": "x"}, headers=auth(GEC_TOKEN))
                       for _ in range(6)]
    finally:
        good.stop()
    assert [a.status_code for a in answers] == [200] * 6


def test_a_csv_body_reaches_a_classic_model_with_its_content_type():
    """MLflow's scoring server reads CSV (and Parquet); the router passes such a body on as it came."""
    iris = FakeReplica("iris-ok").start()
    try:
        with make_router(table_for([], [iris.url])) as client:
            response = client.post("/serving-endpoints/iris/invocations", content=b"a,b\n1,2\n3,4\n",
                                   headers=auth(IRIS_TOKEN) | {"Content-Type": "text/csv"})
    finally:
        iris.stop()
    assert response.status_code == 200 and response.json() == {"predictions": ["iris-ok", "iris-ok"]}
    assert iris.requests == [("/invocations", "a,b\n1,2\n3,4\n")]
    assert iris.headers[-1]["Content-Type"] == "text/csv"


@pytest.mark.parametrize("path, body, status, mlflow_code", [
    ("/serving-endpoints/iris/invocations", b"[1, 2]", 400, "BAD_REQUEST"),
    ("/serving-endpoints/nowhere/invocations", b"{}", 403, "PERMISSION_DENIED"),  # not its token's endpoint
    ("/v1/completions", b'{"model": "gec", "prompt": "hi", "max_tokens": 0}', 400, None),
])
def test_router_errors_have_openais_shape_and_on_invocations_mlflows_code(path, body, status, mlflow_code):
    good, iris = FakeReplica("gec-ok").start(), FakeReplica("iris-ok").start()
    try:
        with make_router(table_for([good.url], [iris.url])) as client:
            token = GEC_TOKEN if path.startswith("/v1") else IRIS_TOKEN
            response = client.post(path, content=body, headers=auth(token) | {"Content-Type": "application/json"})
    finally:
        good.stop(), iris.stop()
    body = response.json()
    assert response.status_code == status and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    if mlflow_code:  # MLflow's clients read error_code and message
        assert (body["error_code"], body["message"]) == (mlflow_code, body["error"]["message"])
    else:  # exactly vLLM's keys on the OpenAI routes, with the field at fault
        assert set(body) == {"error"} and body["error"] | {"message": ""} == {
            "message": "", "type": "BadRequestError", "param": "max_tokens", "code": 400}


@pytest.mark.parametrize("path, body, content_type, status, words", [
    ("/v1/completions", b'{"model": "gec", "prompt": "hi"}', "text/plain", 415, "send 'Content-Type: application/json'"),
    ("/v1/completions", b'{"model": "gec", "prompt": "hi"}', "application/x-www-form-urlencoded", 415, "curl -d"),
    ("/v1/completions", b'{"model": "gec", "prompt": "hi"}', "application/json; charset=latin-1", 415, "application/json"),
    ("/serving-endpoints/iris/invocations", b"a,b\n1,2", "text/plain", 415, "application/json"),
    ("/serving-endpoints/gec/invocations", b"a,b\n1,2", "text/csv", 415, "serves an LLM"),
    ("/v1/completions", b"a,b\n1,2", "text/csv", 415, "the OpenAI API takes JSON"),
    ("/v1/completions", b'{"model": "gec", "prompt": "\xff\xfe"}', "application/json", 400, "not valid UTF-8 (byte 28)"),
    ("/serving-endpoints/iris/invocations", b"\xff\xfe", "application/json", 400, "not valid UTF-8"),
    ("/v1/completions", b'{"model": "gec", "prompt": "hi", "max_tokens": -1}', "application/json", 400, "from 1 to"),
    ("/v1/completions", b'{"model": "gec", "prompt": "hi", "max_tokens": 0}', "application/json", 400, "from 1 to"),
    ("/v1/completions", b'{"model": "gec", "prompt": "hi", "max_tokens": 1e30}', "application/json", 400, "from 1 to"),
    ("/v1/completions", b'{"model": "gec", "prompt": "hi", "max_tokens": "ten"}', "application/json", 400, "whole number"),
    ("/v1/chat/completions", b'{"model": "gec", "messages": [{"role": "user", "content": "hi"}], '
                             b'"max_completion_tokens": -5}', "application/json", 400, "max_completion_tokens must be"),
])
def test_a_wrong_content_type_invalid_utf8_or_a_token_count_out_of_range_is_a_4xx_naming_the_rule(
        path, body, content_type, status, words):
    good, iris = FakeReplica("gec-ok").start(), FakeReplica("iris-ok").start()
    try:
        with make_router(table_for([good.url], [iris.url])) as client:
            token = IRIS_TOKEN if "iris" in path else GEC_TOKEN
            response = client.post(path, content=body, headers=auth(token) | {"Content-Type": content_type})
    finally:
        good.stop(), iris.stop()
    # MLflow's /invocations answers a 415 in plain text, as `mlflow models serve` does
    plain = "invocations" in path and status == 415
    message = response.text if plain else response.json()["error"]["message"]
    assert response.status_code == status and words in message, response.text
    assert response.headers["content-type"].startswith("text/plain" if plain else "application/json")
    assert good.requests == iris.requests == []  # refused before any replica saw it


@pytest.mark.parametrize("gec", ["error"], indirect=True)
def test_a_replica_answering_5xx_is_relayed_with_its_message_and_not_retried(gec):
    bad, good = gec
    with make_router(table_for([bad.url, good.url], [])) as client:
        answers = [client.post("/v1/chat/completions", json=CHAT_BODY, headers=auth(GEC_TOKEN)) for _ in range(16)]
        metrics = client.get("/metrics").text
    failed = [a for a in answers if a.status_code == 500]  # P2C's random ties: none with probability 2^-16
    assert failed and all(a.json()["message"] == "engine failed" for a in failed)
    assert len(failed) == len(bad.requests) and len(good.requests) == 16 - len(failed)  # none moved over
    assert f'modelplane_router_requests_total{{code="500",endpoint="gec"}} {float(len(failed))}' in metrics


@pytest.mark.parametrize("gec", ["huge"], indirect=True)
def test_an_oversize_buffered_answer_is_a_502_with_a_message(gec):
    bad, _ = gec
    with make_router(table_for([bad.url], []), max_response_bytes=1 << 20) as client:
        response = client.post("/v1/chat/completions", json=CHAT_BODY, headers=auth(GEC_TOKEN))
    assert response.status_code == 502
    assert "larger than 1048576 bytes" in response.json()["error"]["message"]


# ---- what tenants must not control ------------------------------------------------------------------

@pytest.fixture
def one_gec():
    replica = FakeReplica("gec-0").start()
    yield replica
    replica.stop()


def test_priority_is_stripped_before_the_engine_sees_it(one_gec):
    with make_router(table_for([one_gec.url], [])) as client:
        for path, body in (("/v1/chat/completions", CHAT_BODY | {"priority": -(2**63)}),
                           ("/serving-endpoints/gec/invocations", {"prompt": "x", "priority": -5})):
            assert client.post(path, json=body, headers=auth(GEC_TOKEN)).status_code == 200
    assert len(one_gec.requests) == 2
    assert all("priority" not in body for _, body in one_gec.requests)


@pytest.mark.parametrize("field, value, words", [
    ("max_tokens", 10**9, "max_tokens"),
    ("max_tokens", 0, "max_tokens"),
    ("max_completion_tokens", 600, "max_completion_tokens"),
    ("n", 100, "'n'"),
    ("best_of", 64, "best_of"),
    ("logprobs", 1000, "logprobs"),
    ("top_logprobs", 50, "top_logprobs"),
    ("max_tokens", "12", "max_tokens"),
    ("n", True, "'n'"),
])
def test_request_sizes_are_bounded_by_the_context_and_documented_limits(one_gec, field, value, words):
    table = table_for([one_gec.url], [])
    table.endpoints["gec"] = table.endpoints["gec"].__class__(**{**table.endpoints["gec"].__dict__,
                                                                 "context_tokens": 512})
    with make_router(table) as client:
        response = client.post("/v1/completions", json={"model": "gec", "prompt": "x", field: value},
                               headers=auth(GEC_TOKEN))
    assert response.status_code == 400 and words in response.json()["error"]["message"]
    assert one_gec.requests == []


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_numbers_are_a_400_naming_the_field(one_gec, number):
    with make_router(table_for([one_gec.url], [])) as client:
        response = client.post("/v1/completions", content=b'{"model": "gec", "prompt": "x", "temperature": '
                               + number + b"}", headers=auth(GEC_TOKEN) | {"Content-Type": "application/json"})
    assert response.status_code == 400 and "temperature" in response.json()["error"]["message"]


def test_model_unit_accounting_stays_finite_whatever_the_request_says(one_gec):
    from serving.router.cost import RouteCost

    table = table_for([one_gec.url], [])
    priced = RouteCost(alpha_ms_per_input_token=0.5, beta_ms_per_output_token=20.0, gamma_ms=30.0, concurrency=4)
    table.endpoints["gec"] = table.endpoints["gec"].__class__(**{**table.endpoints["gec"].__dict__, "cost": priced})
    with make_router(table) as client:
        body = {"model": "gec", "prompt": [[1] * 10] * 10, "max_tokens": 100}
        assert client.post("/v1/completions", json=body, headers=auth(GEC_TOKEN)).status_code == 200
        metrics = client.get("/metrics").text
    assert "nan" not in metrics.lower() and "inf\n" not in metrics.lower()


# ---- malformed input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path, token", [
    ("/serving-endpoints/iris/invocations", IRIS_TOKEN),
    ("/serving-endpoints/gec/invocations", GEC_TOKEN),
    ("/v1/chat/completions", GEC_TOKEN),
])
@pytest.mark.parametrize("body", [nested(5000), b'{"model": "gec", "messages": ' + nested(100) + b"}"])
def test_deeply_nested_json_is_a_400_not_a_500(path, token, body):
    with make_router(table_for([closed_port_url()], [closed_port_url()])) as client:
        response = client.post(path, content=body, headers=auth(token) | {"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert "nested" in response.json()["error"]["message"]


def test_a_token_without_access_gets_the_same_answer_whether_or_not_the_endpoint_exists():
    with make_router(table_for([], [])) as client:
        exists = client.post("/serving-endpoints/iris/invocations", json=IRIS_BODY, headers=auth(GEC_TOKEN))
        missing = client.post("/serving-endpoints/nope/invocations", json=IRIS_BODY, headers=auth(GEC_TOKEN))
        admin_missing = client.post("/serving-endpoints/nope/invocations", json=IRIS_BODY, headers=auth(ADMIN_TOKEN))
    assert exists.status_code == missing.status_code == 403
    assert (exists.json()["error"]["message"].replace("iris", "X")
            == missing.json()["error"]["message"].replace("nope", "X"))
    assert admin_missing.status_code == 404  # a token that may call every endpoint learns it does not exist


@pytest.mark.parametrize("gec", ["cut"], indirect=True)
def test_a_stream_cut_mid_body_ends_the_stream_without_a_500(gec):
    bad, _ = gec
    with make_router(table_for([bad.url], [])) as client:
        with client.stream("POST", "/v1/chat/completions", json=CHAT_BODY | {"stream": True},
                           headers=auth(GEC_TOKEN)) as response:
            assert response.status_code == 200
            chunks = []
            with pytest.raises(Exception):  # noqa: B017 - the body ends abruptly: the client sees a broken stream
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
    assert b"".join(chunks).startswith(b"data: {}")
    assert len(bad.requests) == 1
