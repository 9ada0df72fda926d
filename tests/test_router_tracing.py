"""Traces: the client's W3C trace headers reach the replica; with OTLP configured, the router's
own span is exported and named as the replica's parent. Real sockets throughout: the router
in-process, fake replicas, and a fake OTLP/HTTP collector that decodes what it receives."""

import json
import subprocess
import sys
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.testclient import TestClient

from serving.router import tracing
from serving.router.app import create_app
from serving.router.config import RouterConfig
from serving.router.traffic import Split
from serving.runtime.base import RuntimeConfig
from serving.runtime.vllm_runtime import VllmRuntime, VllmSettings
from tests.conftest import wait_for
from tests.fake_replicas import FakeReplica
from tests.test_router import CHAT_BODY, GEC_TOKEN, IRIS_BODY, IRIS_TOKEN, auth, closed_port_url, table_for

TRACE_ID, CLIENT_PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_PARENT}-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def replicas():
    started = {name: FakeReplica(name).start() for name in ("gec-0", "iris-0")}
    yield started
    for replica in started.values():
        replica.stop()


def router(replicas, tracer=None, table=None) -> TestClient:
    table = table or table_for([replicas["gec-0"].url], [replicas["iris-0"].url])
    return TestClient(create_app(RouterConfig(), lambda: table, tracer=tracer))


def trace_headers(received) -> dict[str, list[str]]:
    """The trace headers a replica received, every value of each (absent: none)."""
    return {name: received.getall(name) for name in ("traceparent", "tracestate") if name in received}


class FakeCollector:
    """An OTLP/HTTP collector on loopback: POST /v1/traces, each body decoded and kept."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf":
                    collector.requests.append(ExportTraceServiceRequest.FromString(body))
                    self.send_response(200)
                else:
                    self.send_response(404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) of every span received."""
        return [({a.key: a.value.string_value for a in rs.resource.attributes}, span)
                for request in self.requests for rs in request.resource_spans
                for ss in rs.scope_spans for span in ss.spans]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def collector():
    started = FakeCollector()
    yield started
    started.stop()


def attributes(span) -> dict:
    values = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        values[a.key] = getattr(a.value, kind)
    return values


# ---- the headers, pure -----------------------------------------------------------------------

@pytest.mark.parametrize("traceparents, tracestates, forwarded", [
    ([TRACEPARENT], [TRACESTATE], {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}),
    ([TRACEPARENT], [], {"traceparent": TRACEPARENT}),
    ([TRACEPARENT], ["congo=t61rcWkgMzE", "rojo=00f067aa0ba902b7"], {"traceparent": TRACEPARENT,
                                                                     "tracestate": TRACESTATE}),  # one list
    ([TRACEPARENT, TRACEPARENT], [TRACESTATE], {}),  # two parents: which one?
    ([], [TRACESTATE], {}),  # a tracestate means nothing without its traceparent
    ([], [], {}),
])
def test_incoming_keeps_a_well_formed_context_and_nothing_else(traceparents, tracestates, forwarded):
    assert tracing.incoming(traceparents, tracestates) == forwarded


@pytest.mark.parametrize("value, valid", [
    (TRACEPARENT, True),
    (f"00-{TRACE_ID}-{CLIENT_PARENT}-00", True),  # not sampled is still a context
    (TRACEPARENT.upper(), False),  # upper-case hex
    (f"00-{'0' * 32}-{CLIENT_PARENT}-01", False),  # all-zero trace id
    (f"00-{TRACE_ID}-{'0' * 16}-01", False),  # all-zero parent id
    (f"01-{TRACE_ID}-{CLIENT_PARENT}-01", False),  # a version this router does not speak
    (f"00-{TRACE_ID[:-1]}-{CLIENT_PARENT}-01", False),  # a short trace id
    (f"00-{TRACE_ID}-{CLIENT_PARENT}-01-extra", False),
    (f" {TRACEPARENT}", False),
    ("", False),
])
def test_valid_traceparent(value, valid):
    assert tracing.valid_traceparent(value) is valid


@pytest.mark.parametrize("environ, endpoint, service", [
    ({}, None, "modelplane-router"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "http://collector:4318/v1/traces", "modelplane-router"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}, "http://collector:4318/v1/traces", "modelplane-router"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:4318/traces",
      "OTEL_SERVICE_NAME": "edge"}, "http://b:4318/traces", "edge"),  # the traces one wins, as it is
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": " ", "OTEL_SERVICE_NAME": ""}, None, "modelplane-router"),
])
def test_tracing_config_reads_the_standard_variables(environ, endpoint, service):
    assert tracing.TracingConfig.from_env(environ) == tracing.TracingConfig(endpoint, service)


# ---- off (the default): forwarded as they came -------------------------------------------------

@pytest.mark.parametrize("sent, forwarded", [
    ({"traceparent": TRACEPARENT, "tracestate": TRACESTATE},
     {"traceparent": [TRACEPARENT], "tracestate": [TRACESTATE]}),
    ({"traceparent": TRACEPARENT}, {"traceparent": [TRACEPARENT]}),
    ({}, {}),
    ({"traceparent": f"00-{'0' * 32}-{CLIENT_PARENT}-01", "tracestate": TRACESTATE}, {}),
    ({"traceparent": "not-a-traceparent"}, {}),
    ({"tracestate": TRACESTATE}, {}),
])
def test_off_the_replica_gets_the_clients_trace_headers_byte_for_byte_or_none(replicas, sent, forwarded):
    with router(replicas) as client:
        chat = client.post("/v1/chat/completions", json=CHAT_BODY, headers={**auth(GEC_TOKEN), **sent})
        scoring = client.post("/serving-endpoints/iris/invocations", json=IRIS_BODY,
                              headers={**auth(IRIS_TOKEN), **sent})
    assert chat.status_code == scoring.status_code == 200
    assert trace_headers(replicas["gec-0"].headers[-1]) == forwarded
    assert trace_headers(replicas["iris-0"].headers[-1]) == forwarded


def test_off_a_stream_and_its_shadow_copy_carry_the_clients_trace_too(replicas):
    shadow = FakeReplica("gec-shadow").start()
    try:
        table = table_for([replicas["gec-0"].url], [replicas["iris-0"].url])
        table.endpoints["gec"] = replace(table.endpoints["gec"], shadow=Split("gec-r2", (shadow.url,), 100.0))
        with router(replicas, table=table) as client:
            with client.stream("POST", "/v1/chat/completions", json={**CHAT_BODY, "stream": True},
                               headers={**auth(GEC_TOKEN), "traceparent": TRACEPARENT}) as streamed:
                assert streamed.status_code == 200
                streamed.read()
            wait_for(lambda: shadow.headers, 10, "the shadow copy")
    finally:
        shadow.stop()
    assert trace_headers(replicas["gec-0"].headers[-1]) == {"traceparent": [TRACEPARENT]}
    assert trace_headers(shadow.headers[-1]) == {"traceparent": [TRACEPARENT]}


def test_off_costs_no_opentelemetry_import():
    """A fresh interpreter: the router app built and started with tracing off (the environment
    holding no OTLP endpoint) has imported nothing of OpenTelemetry."""
    script = """
import sys
from starlette.testclient import TestClient
from serving.router import tracing
from serving.router.app import create_app
from serving.router.config import RouterConfig
from serving.router.table import RoutingTable
tracer = tracing.tracer_from_env({})
assert tracer is None
with TestClient(create_app(RouterConfig(), lambda: RoutingTable(), tracer=tracer)) as client:
    assert client.get("/healthz").status_code == 200
print(sorted(name for name in sys.modules if name.startswith("opentelemetry")))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ---- on: a span of the router's own, exported over OTLP/HTTP ---------------------------------------

@pytest.mark.parametrize("environ, service", [
    (lambda url: {"OTEL_EXPORTER_OTLP_ENDPOINT": url}, "modelplane-router"),
    (lambda url: {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{url}/v1/traces", "OTEL_SERVICE_NAME": "edge"}, "edge"),
])
def test_on_the_replica_gets_the_clients_trace_with_the_router_span_as_parent(replicas, collector, environ, service):
    tracer = tracing.tracer_from_env(environ(collector.url))
    with router(replicas, tracer) as client:
        answered = client.post("/v1/chat/completions", json=CHAT_BODY,
                               headers={**auth(GEC_TOKEN), "traceparent": TRACEPARENT, "tracestate": TRACESTATE})
        assert answered.status_code == 200
    # the router stopped: its last spans were flushed
    received = replicas["gec-0"].headers[-1]
    version, trace_id, parent_id, flags = received["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert parent_id != CLIENT_PARENT
    assert received["tracestate"] == TRACESTATE
    spans = wait_for(lambda: collector.spans(), 5, "the router's span at the collector")
    assert len(spans) == 1
    resource, span = spans[0]
    assert resource["service.name"] == service
    assert span.name == "router gec"
    assert (span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex()) == (TRACE_ID, parent_id,
                                                                                    CLIENT_PARENT)
    assert attributes(span) == {"modelplane.endpoint": "gec", "modelplane.revision": "gec-r1",
                                "modelplane.replica.url": replicas["gec-0"].url, "modelplane.retries": 0,
                                "http.response.status_code": 200}


def test_on_without_a_client_trace_the_router_span_starts_one(replicas, collector):
    tracer = tracing.tracer_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url})
    with router(replicas, tracer) as client:
        assert client.post("/serving-endpoints/iris/invocations", json=IRIS_BODY,
                           headers={**auth(IRIS_TOKEN), "traceparent": "garbage"}).status_code == 200
    received = replicas["iris-0"].headers[-1]
    assert "tracestate" not in received
    assert tracing.valid_traceparent(received["traceparent"])
    _, trace_id, parent_id, _ = received["traceparent"].split("-")
    (_, span), = wait_for(lambda: collector.spans(), 5, "the router's span at the collector")
    assert (span.trace_id.hex(), span.span_id.hex(), span.parent_span_id) == (trace_id, parent_id, b"")


def test_on_a_request_no_replica_could_take_is_an_error_span_with_its_retries(replicas):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    down = [closed_port_url(), closed_port_url()]
    with router(replicas, tracing.OtelTracer(exporter), table_for(down, [replicas["iris-0"].url])) as client:
        refused = client.post("/v1/chat/completions", json=CHAT_BODY,
                              headers={**auth(GEC_TOKEN), "traceparent": TRACEPARENT})
        assert refused.status_code == 503
    (span,) = exporter.get_finished_spans()
    assert span.context.trace_id == int(TRACE_ID, 16) and span.parent.span_id == int(CLIENT_PARENT, 16)
    assert span.status.status_code == StatusCode.ERROR
    recorded = dict(span.attributes)
    assert recorded.pop("modelplane.replica.url") in down  # the last one tried
    assert recorded == {"modelplane.endpoint": "gec", "modelplane.revision": "gec-r1", "modelplane.retries": 1,
                        "http.response.status_code": 503}


# ---- vLLM replicas join the trace ----------------------------------------------------------------

@pytest.fixture
def checkpoint_dir(tmp_path) -> Path:
    """The least a plain checkpoint needs for its command line to be built."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize("environ, endpoint", [
    ({}, None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "http://collector:4318/v1/traces"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, "http://collector:4318/v1/traces"),
])
def test_vllm_exports_its_spans_over_otlp_http_where_the_router_does(checkpoint_dir, monkeypatch, environ, endpoint):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    launch = VllmRuntime(VllmSettings(), accelerator="cuda").command(checkpoint_dir, "127.0.0.1", 8000,
                                                                      RuntimeConfig("gec"))
    if endpoint is None:
        assert "--otlp-traces-endpoint" not in launch.argv
        assert not any(name.startswith("OTEL_") for name in launch.env)
    else:
        assert launch.argv[launch.argv.index("--otlp-traces-endpoint") + 1] == endpoint
        assert launch.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"  # vLLM's default is gRPC
        assert launch.env["OTEL_SERVICE_NAME"] == "modelplane-vllm"
