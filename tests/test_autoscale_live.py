"""The autoscaler for real: pyfunc replicas with a known service time, a real router, the supervisor.

The controller runs in a thread with its real adapters (``benchmarks.autoscale_harness``:
routers' ``/internal/in-flight``, replicas' ``/metrics``, ``LocalCluster.scale``, the
decisions table, the lease), with a 20 s scale-down lookback instead of 300 s so that the
test takes a minute, not ten.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from autoscale.controller.loop import ControllerConfig
from benchmarks.autoscale_harness import BODY, Platform, steady_load
from tests.conftest import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def platform(tmp_path):
    platform = Platform(tmp_path, ControllerConfig(scale_down_window_s=20.0))
    try:
        yield platform
    finally:
        platform.close()


def test_a_load_step_adds_replicas_that_take_traffic_then_idle_removes_them_without_failing_a_request(platform):
    slow = platform.deploy("name: slow\nmodel: models:/slow@champion\nslo: {p99_latency_ms: 2000}\n"
                           "scaling: {min_replicas: 1, max_replicas: 3, target_concurrency: 2}\n")
    platform.start_controller()
    stop, answers = threading.Event(), []
    pool = steady_load(slow, 6, stop, answers)  # 6 in flight at a target of 2: 3 replicas
    ordered_at = wait_for(lambda: (d := platform.decisions.latest("slow", "horizontal")) and d.replicas == 3 and d,
                          20, "a scale-up within 20 s")
    wait_for(lambda: slow.ready() == 3, 60, "the added replicas to be ready")
    time.sleep(3)
    served = len(answers)
    time.sleep(5)
    stop.set()
    pool.shutdown()
    rate_at_three = (len(answers) - served) / 5
    assert ordered_at.rule == "scale-up", ordered_at
    # the in-flight count the router saw, averaged over the lookback: at most the 6 clients, and more
    # than 2 replicas at a target of 2 hold (a busy machine's clients spend part of the window between
    # requests: 5.0 in a clean-clone run of 2026-12-07)
    in_flight = float(re.search(r"in flight ([0-9.]+)", ordered_at.reason).group(1))
    assert 4 < in_flight <= 6, ordered_at.reason
    assert rate_at_three > 15  # one replica serves 10 rows/s; three in rotation serve close to 30

    light_stop = threading.Event()
    pool = steady_load(slow, 1, light_stop, answers)  # 1 in flight: 1 replica is enough
    wait_for(lambda: slow.served_by() == 1, 90, "the scale-down after the 20 s lookback")
    time.sleep(2)
    light_stop.set()
    pool.shutdown()
    down = platform.decisions.latest("slow", "horizontal")
    assert down.replicas == 1 and down.rule == "scale-down"
    assert all(answer.status == 200 for answer in answers), {answer.status for answer in answers}


def test_scaled_to_zero_the_next_request_is_held_and_served(platform):
    slow = platform.deploy("name: slow\nmodel: models:/slow@champion\n"
                           "scaling: {min_replicas: 0, max_replicas: 2, target_concurrency: 2, "
                           "scale_to_zero_grace_s: 5}\n")
    platform.start_controller()
    wait_for(lambda: slow.served_by() == 0, 90, "scale to zero after the lookback and the grace")
    assert platform.decisions.latest("slow", "horizontal").rule == "scale-to-zero"
    started = time.monotonic()
    response = httpx.post(slow.url, json=BODY, headers=slow.headers, timeout=90)
    waited_s = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert platform.decisions.latest("slow", "horizontal").rule == "from-zero"
    assert waited_s < 60  # held for the cold start, within hold_max_s
