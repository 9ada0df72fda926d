"""How the fault table counts: each request's outcome, the tally of a loop, the judged row,
and the request loop process itself against a small server that answers, refuses, fails and hangs."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time

import pytest

from benchmarks.reliability.outcomes import FaultResult, Record, Tally, classify


@pytest.mark.parametrize(("status", "headers", "timed_out", "expected"), [
    (200, {}, False, "ok"),
    (204, {}, False, "ok"),
    (429, {"Retry-After": "1"}, False, "refused"),
    (503, {"retry-after": "5"}, False, "refused"),
    (503, {}, False, "failed"),  # no Retry-After: the client is told nothing it can act on
    (429, {}, False, "failed"),
    (502, {"Retry-After": "1"}, False, "failed"),
    (500, {}, False, "failed"),
    (None, None, False, "failed"),  # refused or reset connection
    (None, None, True, "lost"),
    (200, {}, True, "lost"),
])
def test_classify(status, headers, timed_out, expected):
    assert classify(status, headers, timed_out=timed_out) == expected


def test_a_tally_counts_each_outcome_and_the_first_and_last_bad_request():
    records = [Record(1.0, 0.1, 200, "ok"), Record(2.0, 0.1, 503, "refused"), Record(3.0, 0.1, 502, "failed"),
               Record(4.0, 30.0, 0, "lost"), Record(5.0, 0.2, 200, "ok")]
    tally = Tally.of(records)
    assert (tally.sent, tally.ok, tally.refused, tally.failed, tally.lost) == (5, 2, 1, 1, 1)
    assert (tally.first_bad_s, tally.last_bad_s, tally.max_latency_s) == (3.0, 4.0, 30.0)
    assert tally.failure_rate() == pytest.approx(0.4)


def test_an_unknown_outcome_is_refused():
    with pytest.raises(ValueError, match="unknown outcomes"):
        Tally.of([Record(1.0, 0.1, 200, "fine")])


def test_a_result_passes_only_when_every_check_holds_and_says_which_failed():
    tally = Tally.of([Record(1.0, 0.1, 200, "ok")])
    assert FaultResult.judged("f", "r", tally, {"a": True, "b": True}).passed
    missed = FaultResult.judged("f", "r", tally, {"a": True, "b": False}, detect_s=1.234)
    assert not missed.passed and "failed b" in missed.explain() and missed.detect_s == 1.2
    assert not FaultResult.judged("f", "r", tally, {}).passed  # nothing judged is not a pass


class Scripted(http.server.BaseHTTPRequestHandler):
    """Answers the n-th request by the script: ok, refuse, fail, hang."""

    script = ["ok", "refuse", "fail", "hang"]
    count = 0
    lock = threading.Lock()

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        with Scripted.lock:
            step = Scripted.script[Scripted.count % len(Scripted.script)]
            Scripted.count += 1
        if step == "hang":
            time.sleep(3)
            return
        status, headers = {"ok": (200, {}), "refuse": (503, {"Retry-After": "1"}), "fail": (500, {})}[step]
        body = json.dumps({"step": step}).encode()
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


def test_the_request_loop_process_records_every_outcome_and_loses_the_request_that_hung(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = tmp_path / "loop.jsonl"
    try:
        subprocess.run([sys.executable, "-m", "benchmarks.reliability.requestloop", "--url",
                        f"http://127.0.0.1:{server.server_port}/", "--body", "{}", "--out", str(out),
                        "--concurrency", "1", "--pause-s", "0", "--deadline-s", "1", "--duration-s", "1.5"],
                       check=True, timeout=60, capture_output=True)
    finally:
        server.shutdown()
    outcomes = [json.loads(line)["outcome"] for line in out.read_text().splitlines()]
    assert outcomes[:4] == ["ok", "refused", "failed", "lost"]


def test_the_saturation_row_offers_some_router_twice_what_it_admits_however_connections_split():
    from benchmarks.reliability.bed import ROUTERS, SMOL_SPEC
    from benchmarks.reliability.faults_serving import saturating_clients
    from controlplane.specs import parse_spec

    routing = parse_spec(SMOL_SPEC).routing
    admitted = routing.max_concurrent_requests + routing.max_queued_requests  # per router
    clients = saturating_clients(ROUTERS, admitted)
    assert ROUTERS == 2
    # every way the kernel can hand the clients' keep-alive connections to the two routers
    assert min(max(first, clients - first) for first in range(clients + 1)) >= 2 * admitted
