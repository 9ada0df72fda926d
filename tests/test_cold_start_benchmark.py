"""The cold-start benchmark's parts that can be checked without a model: the throttling link
and how runs become the JSON (the benchmark itself: benchmarks/cold_start.py)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from benchmarks.cold_start import HEADLINE, summarize
from benchmarks.throttle_proxy import Link, ThrottlingProxy
from images.ref import ImageRef, LayerRef

BODY = bytes(range(256)) * 8192  # 2 MiB


@pytest.fixture
def origin():
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_every_byte_crosses_the_link_intact_and_no_faster_than_its_bandwidth(origin):
    with ThrottlingProxy("127.0.0.1", origin, Link(80, 0)) as proxy:  # 10 MB/s
        started = time.monotonic()
        answer = httpx.get(f"{proxy.url}/blob", timeout=30)
        elapsed = time.monotonic() - started
    assert answer.content == BODY
    assert proxy.bytes_down >= len(BODY) and proxy.requests == 1
    assert elapsed >= len(BODY) / Link(80, 0).bytes_per_s * 0.95  # a floor the link sets, not a speed


def test_each_request_on_a_kept_alive_connection_waits_the_request_delay(origin):
    with ThrottlingProxy("127.0.0.1", origin, Link(10_000, 50)) as proxy, httpx.Client(timeout=30) as client:
        started = time.monotonic()
        for _ in range(3):
            assert client.get(f"{proxy.url}/blob").status_code == 200
        elapsed = time.monotonic() - started
    assert proxy.requests == 3
    assert elapsed >= 3 * 0.050


def _image(image_bytes: int) -> ImageRef:
    layer = LayerRef("env", "opt/modelplane/env", "sha256:" + "1" * 64, image_bytes, "sha256:" + "2" * 64,
                     "sha256:" + "3" * 64, image_bytes // 2, image_bytes, 3)
    return ImageRef("http://r", "bench/x", "v1", "sha256:" + "0" * 64, "sha256:" + "4" * 64, "vllm",
                    "/usr/bin/python3", "3.11.7", (layer,))


def test_the_headline_is_full_pull_over_lazy_prefetch_at_200_mbit_and_the_share_is_of_the_image():
    def run(seconds, fetched):
        return {"seconds": seconds, "bytes": fetched, "requests": 5, "engine_s": 1.0, "pull_s": 1.0,
                "extract_s": 1.0}
    outcome = {"image": _image(1000), "facts": {"image_bytes": 1000, "build_s": 9.0, "layers": {}},
               "points": {HEADLINE.label(): {"full_pull": [run(100, 1000), run(120, 1000), run(110, 1000)],
                                             "lazy_prefetch": [run(20, 200), run(30, 300), run(22, 250)]}}}
    summary = summarize(outcome)
    assert summary["speedup"] == pytest.approx(110 / 22)
    assert summary["share_before_ready"] == pytest.approx(0.25)
    assert summary["table"][HEADLINE.label()]["full_pull"]["seconds"] == {"min": 100, "median": 110, "max": 120, "n": 3}
    assert summary["conversion"]["storage_overhead"] == 0.5
