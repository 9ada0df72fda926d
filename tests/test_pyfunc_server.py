"""The pyfunc scoring server: MLflow's /invocations protocol, micro-batching, metrics, PyfuncRuntime.

Pure logic (payload parsing, batching decisions, thread counts, probe building) is tested
without a server; the ASGI app with a fake predictor; then the real server, started as
`python -m serving.runtime.pyfunc` from PyfuncRuntime.command(), on the demo iris model
logged to and downloaded from a real MLflow registry.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import mlflow.pyfunc
import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from serving.runtime.base import RuntimeConfig
from serving.runtime.pyfunc import PyfuncRuntime
from serving.runtime.pyfunc.app import PyfuncApp, Readiness
from serving.runtime.pyfunc.batching import BatchPolicy, dispatch_delay_s, row_bounds, select_batch
from serving.runtime.pyfunc.config import PyfuncServerConfig, thread_env, threads_per_worker
from serving.runtime.pyfunc.metrics import ServerMetrics
from serving.runtime.pyfunc.payload import InvocationError, check_content_type, parse_invocation
from serving.runtime.pyfunc.responses import Outcome
from serving.runtime.pyfunc.runtime import first_row_of, request_from_signature
from serving.tls import tls_context
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ["sepal length (cm)", "sepal width (cm)", "petal length (cm)", "petal width (cm)"]
ROWS = [[5.1, 3.5, 1.4, 0.2], [5.7, 2.8, 4.1, 1.3], [6.3, 3.3, 6.0, 2.5]]  # one of each species


def split(rows=ROWS, columns=COLUMNS, **extra) -> dict:
    return {"dataframe_split": {"columns": columns, "data": rows}, **extra}


def encode(payload) -> bytes:
    return msgspec.json.encode(payload)


# --- payload: the envelope ------------------------------------------------------------------

@pytest.mark.parametrize("content_type, body_format", [
    ("application/json", "json"),
    ("application/json; charset=utf-8", "json"),
    ("Application/JSON; charset=UTF-8", "json"),
    ("text/csv", "csv"),
    ("text/csv; charset=utf-8", "csv"),
    ("application/vnd.apache.parquet", "parquet"),
    (None, None),
    ("text/plain", None),
    ("application/json; charset=latin-1", None),
    ("application/json; format=pandas-split", None),
])
def test_the_content_types_mlflow_reads_are_accepted_and_others_are_a_plain_415(content_type, body_format):
    if body_format:
        assert check_content_type(content_type) == body_format
    else:
        with pytest.raises(InvocationError) as error:
            check_content_type(content_type)
        assert error.value.status == 415 and error.value.plain_text
        assert "application/json" in error.value.message or "UTF-8" in error.value.message


@pytest.mark.parametrize("body, message", [
    (b'{"dataframe_split": ', "not valid UTF-8 JSON"),
    (b"\xff\xfe", "not valid UTF-8 JSON"),
    (b"[1, 2]", "got a JSON list"),
    (b'{"data": [[1]]}', "keys were: data"),
    (encode({**split(), "inputs": [[1]]}), "found dataframe_split, inputs"),
    (encode(split(params=[1])), "'params' must be a JSON object"),
    (encode(split(rows=[])), "holds no rows"),
    (encode({"dataframe_records": []}), "holds no rows"),
    (encode({"dataframe_split": [[1]]}), "must be an object with 'data'"),
    (encode({"dataframe_split": {"rows": [[1]]}}), "got keys ['rows']"),
    (encode({"dataframe_records": {"a": 1}}), "must be a list of records"),
    (b"[" * 5000 + b"]" * 5000, "nested more than 32 levels"),
    (b'{"instances": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}", "nested more than 32 levels"),
])
def test_a_malformed_envelope_is_a_400_that_says_what_to_send(body, message):
    with pytest.raises(InvocationError) as error:
        parse_invocation(body)
    assert error.value.status == 400
    assert message in error.value.message


@pytest.mark.parametrize("body, expected", [
    (b'{"inputs": [NaN, Infinity, -Infinity]}', [float("nan"), float("inf"), float("-inf")]),
    (b'{"inputs": [1e400, -1e400]}', [float("inf"), float("-inf")]),
])
def test_non_finite_numbers_are_read_as_mlflow_reads_them(body, expected):
    np.testing.assert_array_equal(parse_invocation(body).input_value, expected)


@pytest.mark.parametrize("document", [
    {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.1},
    {"prompt": "hi", "max_tokens": 5},
    {"input": ["a", "b"]},
    {"messages": [], "inputs": [[1]]},  # MLflow looks for the LLM keys first
])
def test_a_chat_completion_or_embedding_body_is_one_unified_llm_input(document):
    invocation = parse_invocation(encode(document))
    assert (invocation.input_key, invocation.input_value, invocation.batch_key) == ("llm", document, None)


def test_csv_and_parquet_bodies_are_kept_for_mlflows_parsers():
    csv = parse_invocation(b"a,b\n1,2\n3,4\n", body_format="csv")
    assert (csv.input_key, csv.input_value, csv.row_count, csv.batch_key) == ("csv", b"a,b\n1,2\n3,4\n", 2, None)
    with pytest.raises(InvocationError, match="CSV body is empty"):
        parse_invocation(b"\n", body_format="csv")


def test_both_dataframe_formats_become_the_same_rows_and_share_a_batch_key():
    from_split = parse_invocation(encode(split(ROWS[:1])))
    records = [dict(zip(COLUMNS, row)) for row in ROWS[1:]]
    from_records = parse_invocation(encode({"dataframe_records": records}))
    assert from_split.frame.rows == [ROWS[0]] and from_split.row_count == 1
    assert from_records.frame.rows == ROWS[1:] and from_records.row_count == 2
    assert from_records.frame.columns == tuple(COLUMNS)
    assert from_split.batch_key == from_records.batch_key is not None


@pytest.mark.parametrize("payload, why", [
    ({"instances": [dict(zip(COLUMNS, ROWS[0]))]}, "tensor format"),
    ({"inputs": {c: [v] for c, v in zip(COLUMNS, ROWS[0])}}, "tensor format"),
    ({"dataframe_split": {"columns": COLUMNS, "data": ROWS[:1], "index": [7]}}, "an index"),
    ({"dataframe_split": {"columns": COLUMNS, "data": [[1, 2, 3]]}}, "ragged rows: MLflow's parser reports it"),
    ({"dataframe_records": [{"a": 1}, {"b": 2}]}, "records with different columns"),
])
def test_inputs_that_cannot_be_concatenated_get_no_batch_key(payload, why):
    assert parse_invocation(encode(payload)).batch_key is None, why


def test_requests_with_different_params_or_columns_do_not_share_a_batch():
    plain = parse_invocation(encode(split()))
    assert parse_invocation(encode(split(params={"b": 1, "a": 2}))).batch_key == \
        parse_invocation(encode(split(params={"a": 2, "b": 1}))).batch_key  # key order does not matter
    assert parse_invocation(encode(split(params={"a": 1}))).batch_key != plain.batch_key
    assert parse_invocation(encode(split([r[::-1] for r in ROWS], COLUMNS[::-1]))).batch_key != plain.batch_key
    assert parse_invocation(encode(split()), concatenate_frames=False).batch_key is None


# --- batching decisions ---------------------------------------------------------------------

POLICY = BatchPolicy(max_batch_rows=64, max_batch_wait_ms=2.0)


@pytest.mark.parametrize("now_s, queued_rows, arriving, expected_s", [
    (10.0005, 3, 2, 0.0015),  # others are being read: wait for them, up to 2 ms after the oldest
    (10.0030, 3, 2, 0.0),  # the oldest waited 2 ms already
    (10.0005, 3, 0, 0.0),  # nobody else is coming: a lone client never waits
    (10.0005, 64, 5, 0.0),  # a full batch goes now
])
def test_when_the_next_batch_runs(now_s, queued_rows, arriving, expected_s):
    delay = dispatch_delay_s(POLICY, now_s=now_s, oldest_enqueued_s=10.0, queued_rows=queued_rows,
                             arriving_requests=arriving)
    assert delay == pytest.approx(expected_s)


class Queued:
    def __init__(self, batch_key, row_count):
        self.batch_key, self.row_count = batch_key, row_count


@pytest.mark.parametrize("queue, expected", [
    ([("A", 1), ("B", 1), ("A", 2), ("A", 63), ("A", 4)], [0, 2, 4]),  # same key, within 64 rows
    ([(None, 1), (None, 1)], [0]),  # no key: alone
    ([("A", 100), ("A", 1)], [0]),  # a request over the cap still runs, alone
    ([("A", 1)] * 70, list(range(64))),  # capped at 64 rows
    ([], []),
])
def test_which_requests_share_a_predict_call(queue, expected):
    assert select_batch([Queued(k, n) for k, n in queue], max_batch_rows=64) == expected


def test_row_bounds_split_a_batch_back_per_request():
    assert row_bounds([1, 3, 2]) == [(0, 1), (1, 4), (4, 6)]


@pytest.mark.parametrize("cpus, workers, threads", [(8, 1, 8), (8, 3, 2), (1.5, 2, 1), (2, 2, 1), (0.5, 1, 1)])
def test_threads_are_the_cpu_quota_divided_across_workers(cpus, workers, threads):
    assert threads_per_worker(cpus, workers) == threads
    assert thread_env(cpus, workers)["OMP_NUM_THREADS"] == str(threads)


def test_config_rejects_impossible_values_with_all_problems_named():
    with pytest.raises(ValueError, match="workers must be ≥ 1.*max_batch_rows must be ≥ 1"):
        PyfuncServerConfig(model_dir=Path("m"), workers=0, max_batch_rows=0)


# --- PyfuncRuntime without a server ---------------------------------------------------------

def test_command_runs_the_module_with_batching_flags_and_thread_counts(tmp_path):
    launch = PyfuncRuntime().command(tmp_path, "127.0.0.1", 9000,
                                     RuntimeConfig(model_name="iris", cpu_cores=4, workers=2, max_batch_size=32))
    argv = launch.argv
    assert argv[1:3] == ["-m", "serving.runtime.pyfunc"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags == {"--model-dir": str(tmp_path), "--host": "127.0.0.1", "--port": "9000", "--workers": "2",
                     "--max-batch-size": "32", "--max-batch-wait-ms": "2.0"}
    assert launch.env["OMP_NUM_THREADS"] == launch.env["OPENBLAS_NUM_THREADS"] == "2"
    assert str(REPO) in launch.env["PYTHONPATH"].split(os.pathsep)


@pytest.mark.parametrize("specs, expected", [
    ([{"type": "double", "name": "x"}, {"type": "long", "name": "n"}, {"type": "string", "name": "s"},
      {"type": "boolean", "name": "b"}],
     {"dataframe_split": {"columns": ["x", "n", "s", "b"], "data": [[0.0, 0, "", False]]}}),
    ([{"type": "tensor", "tensor-spec": {"dtype": "float32", "shape": [-1, 2, 2]}}], {"inputs": [[[0, 0], [0, 0]]]}),
    ([{"type": "tensor", "name": "t", "tensor-spec": {"dtype": "int64", "shape": [-1]}}], {"inputs": {"t": [0]}}),
])
def test_probe_from_a_signature_is_one_placeholder_row(specs, expected):
    assert request_from_signature(specs) == expected


def test_probe_from_an_example_keeps_only_its_first_row():
    example = {"dataframe_records": [{"a": 1}, {"a": 2}], "params": {"t": 1}}
    assert first_row_of(example) == {"dataframe_records": [{"a": 1}], "params": {"t": 1}}


def test_progress_sums_what_several_workers_report():
    text = ("# TYPE modelplane_pyfunc_requests_completed_total counter\n"
            "modelplane_pyfunc_requests_completed_total 12.0\n"
            "# TYPE modelplane_pyfunc_requests_in_flight gauge\n"
            "modelplane_pyfunc_requests_in_flight 3.0\n"
            "# TYPE modelplane_pyfunc_queue_depth gauge\n"
            "modelplane_pyfunc_queue_depth 2.0\n")
    progress = PyfuncRuntime().progress(text)
    assert (progress.completed_total, progress.in_flight, progress.queued) == (12.0, 3.0, 2.0)
    assert PyfuncRuntime().progress("").completed_total == 0.0


# --- the ASGI app with a fake predictor -----------------------------------------------------

class EchoPredictor:
    """Answers each request with its own rows; records the size of every predict call."""

    concatenates_frames = True

    def __init__(self):
        self.batches: list[int] = []

    def predict_batch(self, batch):
        self.batches.append(len(batch))
        return [Outcome(200, encode({"predictions": item.frame.rows})) for item in batch]


class AsgiClient:
    """Drives an ASGI app in-process: lifespan, then requests (optionally with a chunked body)."""

    def __init__(self, app):
        self.app, self.inbox, self.outbox = app, asyncio.Queue(), asyncio.Queue()

    async def __aenter__(self):
        self.task = asyncio.create_task(self.app({"type": "lifespan"}, self.inbox.get, self.outbox.put))
        await self.inbox.put({"type": "lifespan.startup"})
        assert (await self.outbox.get())["type"] == "lifespan.startup.complete"
        return self

    async def __aexit__(self, *exc):
        await self.inbox.put({"type": "lifespan.shutdown"})
        await self.outbox.get()
        await self.task

    async def request(self, method, path, chunks=(b"",), content_type="application/json"):
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
        sent = []

        async def receive():
            return messages.pop(0)

        async def send(message):
            sent.append(message)

        headers = [(b"content-type", content_type.encode())] if content_type else []
        await self.app({"type": "http", "method": method, "path": path, "headers": headers}, receive, send)
        is_json = dict(sent[0]["headers"])[b"content-type"] == b"application/json" and path != "/version"
        return sent[0]["status"], msgspec.json.decode(sent[1]["body"]) if is_json else sent[1]["body"]


def make_app(predictor, gate: threading.Event | None = None, **config) -> PyfuncApp:
    def load(model_dir):
        if gate is not None:
            assert gate.wait(10)
        return predictor

    return PyfuncApp(PyfuncServerConfig(model_dir=Path("unused"), **config), ServerMetrics(CollectorRegistry()),
                     Readiness(), load, on_fatal=lambda exc: None)


async def until_healthy(client: AsgiClient, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await client.request("GET", "/health"))[0] != 200:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def test_health_is_503_until_the_model_has_loaded_then_200():
    async def scenario():
        gate = threading.Event()
        async with AsgiClient(make_app(EchoPredictor(), gate)) as client:
            assert (await client.request("GET", "/health"))[0] == 503
            status, body = await client.request("POST", "/invocations", [encode(split())])
            assert (status, body["error_code"]) == (503, "TEMPORARILY_UNAVAILABLE")
            gate.set()
            await until_healthy(client)
            assert (await client.request("POST", "/invocations", [encode(split())]))[0] == 200

    asyncio.run(scenario())


def test_concurrent_requests_share_predict_calls_and_each_gets_its_own_rows():
    async def scenario():
        predictor = EchoPredictor()
        async with AsgiClient(make_app(predictor)) as client:
            await until_healthy(client)
            bodies = [split([[float(i), 0, 0, 0]] * (i % 3 + 1)) for i in range(32)]
            bodies += [split([[float(i), 0, 0, 0]], params={"temperature": 1}) for i in range(32, 36)]
            answers = await asyncio.gather(*(client.request("POST", "/invocations", [encode(b)]) for b in bodies))
        for body, (status, answer) in zip(bodies, answers):
            assert status == 200 and answer["predictions"] == body["dataframe_split"]["data"]
        # 63 rows without params in one call, then the 4 requests with params in their own.
        assert predictor.batches == [32, 4]

    asyncio.run(scenario())


def test_a_chunked_body_over_the_limit_is_413_an_unread_type_a_plain_415_and_version_mlflows():
    async def scenario():
        async with AsgiClient(make_app(EchoPredictor(), max_body_bytes=100)) as client:
            await until_healthy(client)
            status, body = await client.request("POST", "/invocations", [b"x" * 60, b"x" * 60])
            assert status == 413 and "limit of 100 bytes" in body["message"]
            status, body = await client.request("POST", "/invocations", [b"a,b\n1,2"], content_type="text/plain")
            assert (status, body) == (415, b"This predictor only supports the following content types: Types: "
                                           b"['application/json', 'text/csv', 'application/vnd.apache.parquet']. "
                                           b"Got 'text/plain'.")
            assert await client.request("GET", "/version") == (200, mlflow.__version__.encode())
            assert (await client.request("GET", "/invocations"))[0] == 405
            assert (await client.request("GET", "/nowhere"))[0] == 404

    asyncio.run(scenario())


# --- the real iris model, in-process --------------------------------------------------------

@pytest.fixture(scope="module")
def iris_dir(tmp_path_factory) -> Path:
    """The demo iris model, logged to a real MLflow registry (SQLite) and downloaded from it."""
    from mlflow import MlflowClient

    from demo.iris import log_iris
    from pipelines.registry import MlflowRegistry

    root = tmp_path_factory.mktemp("iris")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).create_experiment("modelplane-demo",
                                                     artifact_location=(root / "artifacts").as_uri())
    log_iris(uri)
    return MlflowRegistry(uri).download("iris", "1", root / "model")


@pytest.fixture(scope="module")
def iris_model(iris_dir):
    return mlflow.pyfunc.load_model(str(iris_dir))


def expected_predictions(model, rows=ROWS) -> list:
    """What the model's own pyfunc predict says."""
    import pandas as pd

    return model.predict(pd.DataFrame(rows, columns=COLUMNS)).tolist()


def outcome_json(outcome: Outcome):
    return outcome.status, msgspec.json.decode(outcome.body)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [
    ROWS,
    [[5, 3, 1, 0]],  # ints
    [["5.1", 3.5, True, 0.2]],  # a numeric string and a bool, as pandas' astype converts them
    [[None, 3.5, 1.4, 0.2]],  # a null becomes NaN
    [[1e308, -0.0, 2**70, 0]],
])
def test_the_numeric_fast_path_reads_rows_as_mlflow_does(iris_model, rows):
    import pandas as pd
    from mlflow.utils.proto_json_utils import dataframe_from_parsed_json

    from serving.runtime.pyfunc.predictor import numeric_frame, uniform_numeric_dtype

    schema = iris_model.metadata.get_input_schema()
    assert uniform_numeric_dtype(schema) is np.float64
    mlflow_frame = dataframe_from_parsed_json({"columns": COLUMNS, "data": rows}, "split", schema)
    pd.testing.assert_frame_equal(numeric_frame(tuple(COLUMNS), rows, np.float64), mlflow_frame)


@pytest.mark.parametrize("rows", [[["wide", 1, 1, 1]], [[[1, 2], 1, 1, 1]], [[1, 2, 3]], [[{"a": 1}, 1, 1, 1]]])
def test_the_numeric_fast_path_declines_what_it_cannot_read(rows):
    from serving.runtime.pyfunc.predictor import numeric_frame

    assert numeric_frame(tuple(COLUMNS), rows, np.float64) is None


@pytest.mark.slow
def test_a_bad_request_in_a_batch_fails_alone_with_its_own_status(iris_model):
    from serving.runtime.pyfunc.predictor import PyfuncPredictor

    predictor = PyfuncPredictor(iris_model)
    batch = [split(ROWS[:1]), split([["x", 1, 1, 1]]), split(ROWS[1:]), split([[None, 1, 1, 1]])]
    outcomes = [outcome_json(o) for o in predictor.predict_batch([parse_invocation(encode(b)) for b in batch])]
    assert [status for status, _ in outcomes] == [200, 400, 200, 400]
    assert outcomes[0][1]["predictions"] + outcomes[2][1]["predictions"] == expected_predictions(iris_model)
    assert "sepal length (cm)" in outcomes[1][1]["message"]  # the column whose value is not a double
    assert "missing or infinite (null/NaN/±Infinity) values in ['sepal length (cm)']" in outcomes[3][1]["message"]
    assert [body["error_code"] for _, body in outcomes[1::2]] == ["BAD_REQUEST", "BAD_REQUEST"]


class FailsOnThirteen(mlflow.pyfunc.PythonModel):
    """Doubles x, and raises on x == 13: a model bug on input that passes its signature."""

    def predict(self, context, model_input, params=None):
        if (model_input["x"] == 13).any():
            raise RuntimeError("thirteen is unlucky")
        return model_input["x"] * 2


@pytest.mark.slow
def test_a_model_exception_on_valid_input_is_a_400_for_that_request_only(tmp_path):
    """As in MLflow's server: the model rejected its input, which is the client's to fix; a 5xx
    would count against a healthy replica (outlier ejection, alerts, the bake rollback)."""
    import pandas as pd
    from mlflow.models import infer_signature

    from serving.runtime.pyfunc.predictor import PyfuncPredictor

    path = tmp_path / "thirteen"
    mlflow.pyfunc.save_model(str(path), python_model=FailsOnThirteen(), pip_requirements=[],
                             signature=infer_signature(pd.DataFrame({"x": [1.0]}), pd.Series([2.0], name="x")))
    predictor = PyfuncPredictor.load(path)
    batch = [{"dataframe_split": {"columns": ["x"], "data": [[x]]}} for x in (1.0, 13.0, 2.0)]
    outcomes = [outcome_json(o) for o in predictor.predict_batch([parse_invocation(encode(b)) for b in batch])]
    assert outcomes[0] == (200, {"predictions": [{"x": 2.0}]})
    assert outcomes[1][0] == 400 and "RuntimeError: thirteen is unlucky" in outcomes[1][1]["message"]
    assert outcomes[1][1]["error_code"] == "BAD_REQUEST"
    assert outcomes[2] == (200, {"predictions": [{"x": 4.0}]})


# --- the real server ------------------------------------------------------------------------

class ServerProcess:
    """`python -m serving.runtime.pyfunc` as PyfuncRuntime.command() starts it."""

    def __init__(self, model_dir: Path, log_path: Path, config: RuntimeConfig,
                 extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launch = PyfuncRuntime().command(model_dir, "127.0.0.1", self.port, config)
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(launch.argv, cwd=REPO, env={**os.environ, **launch.env, **(extra_env or {})},
                                            stdout=log, stderr=subprocess.STDOUT)
        self.health_seen: list[int] = []

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            try:
                self.health_seen.append(httpx.get(f"{self.url}/health", timeout=2, verify=tls_context()).status_code)
                if self.health_seen[-1] == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise AssertionError(f"not healthy after {timeout_s} s: {self.log_path.read_text()[-3000:]}")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def metrics_text(self) -> str:
        return httpx.get(f"{self.url}/metrics").text


@pytest.fixture(scope="module")
def server(iris_dir, tmp_path_factory):
    server = ServerProcess(iris_dir, tmp_path_factory.mktemp("logs") / "server.log",
                           RuntimeConfig(model_name="iris"))
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def invoke(server: ServerProcess, payload=None, *, content: bytes | None = None,
           content_type: str = "application/json") -> httpx.Response:
    body = encode(payload) if content is None else content
    return httpx.post(f"{server.url}/invocations", content=body, headers={"content-type": content_type}, timeout=30)


@pytest.mark.slow
def test_health_is_503_while_loading_then_200(server):
    # polled every 20 ms from the start: the port answers before the model has loaded
    assert 503 in server.health_seen and set(server.health_seen[:-1]) == {503} and server.health_seen[-1] == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("payload", [
    pytest.param(split(), id="dataframe_split"),
    pytest.param({"dataframe_records": [dict(zip(COLUMNS, row)) for row in ROWS]}, id="dataframe_records"),
    pytest.param({"instances": [dict(zip(COLUMNS, row)) for row in ROWS]}, id="instances"),
    pytest.param({"inputs": {c: [row[i] for row in ROWS] for i, c in enumerate(COLUMNS)}}, id="inputs-columns"),
    pytest.param({"inputs": [dict(zip(COLUMNS, row)) for row in ROWS]}, id="inputs-records"),
    pytest.param(split(params={"unused": 1}), id="params-accepted"),
])
def test_every_input_format_predicts_what_the_model_itself_predicts(server, iris_model, payload):
    response = invoke(server, payload)
    assert response.status_code == 200, response.text
    assert response.json() == {"predictions": expected_predictions(iris_model)}


@pytest.mark.slow
@pytest.mark.parametrize("content, content_type, status, message", [
    (b'{"dataframe_split": {', "application/json", 400, "not valid UTF-8 JSON"),
    (encode({"rows": ROWS}), "application/json", 400, "exactly one of dataframe_split"),
    (encode({**split(), "instances": ROWS}), "application/json", 400, "found dataframe_split, instances"),
    (encode(split([[1.0, 2.0, 3.0]])), "application/json", 400, "4 columns passed, passed data had 3 columns"),
    (encode(split([r[:3] for r in ROWS], COLUMNS[:3])), "application/json", 400,
     "Model is missing inputs ['petal width (cm)']"),
    (encode(split([["wide", 3.5, 1.4, 0.2]])), "application/json", 400,
     "Failed to convert column sepal length (cm) to type 'float64'"),
    (encode(split([[5.1, None, 1.4, 0.2]])), "application/json", 400, "missing or infinite (null/NaN/±Infinity) values in ['sepal width"),
    (b"a,b\n1,2\n", "text/csv", 400, "Model is missing inputs"),
    (b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json", 400, "nested more than 32 levels"),
])
def test_bad_input_gets_a_4xx_that_names_the_problem(server, content, content_type, status, message):
    response = invoke(server, content=content, content_type=content_type)
    assert response.status_code == status, response.text
    assert message in response.json()["message"]


@pytest.mark.slow
def test_a_body_over_8_mib_is_413(server):
    rows = [[5.1, 3.5, 1.4, 0.2]] * 600_000  # 18 bytes a row: ~10 MiB of JSON
    response = invoke(server, split(rows))
    assert response.status_code == 413
    assert "limit of 8388608 bytes" in response.json()["message"]


def batches_over_one(metrics_text: str) -> float:
    """How many predict calls took more than one request (from the batch size histogram)."""
    samples = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(metrics_text)
               for s in f.samples}
    return (samples[("modelplane_pyfunc_batch_size_requests_count", None)]
            - samples[("modelplane_pyfunc_batch_size_requests_bucket", "1.0")])


@pytest.mark.slow
def test_concurrent_requests_are_batched_and_each_gets_its_own_predictions(server, iris_model):
    from sklearn.datasets import load_iris

    features = load_iris(as_frame=True).data.to_numpy().tolist()
    bodies = [features[(5 * i) % 150:(5 * i) % 150 + i % 3 + 1] for i in range(32)]  # 1-3 rows, all species
    before = batches_over_one(server.metrics_text())

    async def fire():
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(client.post(f"{server.url}/invocations", json=split(rows))
                                          for rows in bodies))

    responses = asyncio.run(fire())
    for rows, response in zip(bodies, responses):
        assert response.status_code == 200
        assert response.json()["predictions"] == expected_predictions(iris_model, rows)
    assert batches_over_one(server.metrics_text()) > before


@pytest.mark.slow
def test_progress_reads_a_real_scrape(server):
    runtime = PyfuncRuntime()
    before = runtime.progress(server.metrics_text())
    for _ in range(3):
        assert invoke(server, split()).status_code == 200
    assert invoke(server, content=b"{").status_code == 400  # rejected before predict: not progress
    after = runtime.progress(server.metrics_text())
    assert after.completed_total == before.completed_total + 3
    assert (after.in_flight, after.queued) == (0, 0)


@pytest.mark.slow
def test_the_probe_request_is_answered_200(server, iris_dir, tmp_path):
    runtime, config = PyfuncRuntime(), RuntimeConfig(model_name="iris")
    from_example = runtime.probe_request(iris_dir, config)
    (tmp_path / "MLmodel").write_bytes((iris_dir / "MLmodel").read_bytes())  # no serving_input_example.json
    from_signature = runtime.probe_request(tmp_path, config)
    assert from_signature.json == {"dataframe_split": {"columns": COLUMNS, "data": [[0.0, 0.0, 0.0, 0.0]]}}
    for probe in (from_example, from_signature):
        response = httpx.post(f"{server.url}{probe.path}", json=probe.json)
        assert response.status_code == 200 and len(response.json()["predictions"]) == 1
    import yaml

    mlmodel = yaml.safe_load((iris_dir / "MLmodel").read_text())
    mlmodel.pop("signature")
    (tmp_path / "MLmodel").write_text(yaml.safe_dump(mlmodel))  # neither an example nor a signature
    assert runtime.probe_request(tmp_path, config) is None  # loaded is ready: nothing says what it takes


@pytest.mark.slow
def test_two_workers_share_the_port_and_their_metrics(iris_dir, tmp_path):
    from prometheus_client.mmap_dict import MmapedDict

    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    server = ServerProcess(iris_dir, tmp_path / "server.log", RuntimeConfig(model_name="iris", workers=2),
                           extra_env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    try:
        server.wait_healthy()
        for _ in range(20):  # a new connection each: the kernel spreads them over both workers
            with httpx.Client() as client:
                assert client.post(f"{server.url}/invocations", json=split()).status_code == 200
        progress = PyfuncRuntime().progress(server.metrics_text())
        assert progress.completed_total == 20  # whichever worker answered the scrape, it sums both
        completed_by_worker = {}
        for path in metrics_dir.glob("counter_*.db"):
            values = MmapedDict.read_all_values_from_file(str(path))
            completed_by_worker[path.stem] = sum(value for key, value, *_ in values
                                                  if "requests_completed_total" in key)
        assert len([n for n in completed_by_worker.values() if n > 0]) == 2, completed_by_worker
    finally:
        exit_code = server.stop()
    assert exit_code == 0, server.log_path.read_text()[-3000:]
