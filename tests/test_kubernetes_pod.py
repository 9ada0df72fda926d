"""What a replica pod runs, run here as processes: the launcher that starts the runtime in its
own place, the forward-progress liveness probe and the preStop drain (cluster.kubernetes.probes)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from cluster.kubernetes.probes import drain, live, read_state
from serving.runtime.process import free_port
from serving.tls import tls_context

ROWS = {"dataframe_split": {"columns": ["sepal length (cm)", "sepal width (cm)", "petal length (cm)",
                                        "petal width (cm)"], "data": [[5.1, 3.5, 1.4, 0.2]]}}


@pytest.fixture
def pod(iris_dir, tmp_path):
    """The replica container's command, as the Deployment gives it (host and port aside)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "serving.runtime.launch", "--runtime", "pyfunc", "--model-dir",
                                str(iris_dir), "--model-name", "iris", "--host", "127.0.0.1", "--port", str(port),
                                "--config-json", '{"workers": 1, "cpu_cores": 1}'], start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, verify=tls_context()).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
        assert process.poll() is None, "the launcher exited before the server answered"
        time.sleep(0.3)
    args = argparse.Namespace(runtime="pyfunc", port=port, model_dir=str(iris_dir), model_name="iris",
                              state=str(tmp_path / "liveness.json"), probe_timeout_s=8.0, settle_s=0.0, timeout_s=10.0,
                              liveness="{}")
    try:
        yield process, port, args
    finally:
        os.killpg(process.pid, signal.SIGCONT)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def test_the_launcher_becomes_the_server_itself_so_the_pods_signals_reach_it(pod):
    process, port, _ = pod
    answer = httpx.post(f"http://127.0.0.1:{port}/invocations", json=ROWS, timeout=30)
    assert answer.status_code == 200 and len(answer.json()["predictions"]) == 1
    with open(f"/proc/{process.pid}/cmdline", "rb") as cmdline:  # exec'd: the same pid runs the server
        assert b"serving.runtime.pyfunc" in cmdline.read()


def test_an_idle_replica_is_probed_and_lives_and_a_stopped_one_is_found_hung(pod):
    process, port, args = pod
    assert live(args, now_s=1000.0) == 0  # first look: the clock starts
    assert live(args, now_s=1031.0) == 0  # idle 31 s: the probe request is sent, and answered
    assert read_state(args.state)[0].probe_sent_at_s == 1031.0
    assert live(args, now_s=1032.0) == 0
    assert read_state(args.state)[0].probe_sent_at_s is None  # its completion moved the counter
    os.killpg(process.pid, signal.SIGSTOP)  # a silent hang: nothing answers, nothing moves
    assert live(args, now_s=1040.0) == 0  # /metrics unanswered: not hung yet
    assert live(args, now_s=1055.0) == 0
    assert live(args, now_s=1061.0) == 1  # unanswered for unanswered_after_s (20 s): the kubelet restarts it


def test_the_drain_hook_returns_once_nothing_is_in_flight(pod):
    _, _, args = pod
    started = time.monotonic()
    assert drain(args) == 0
    assert time.monotonic() - started < args.timeout_s  # idle: no need to wait out the budget


def test_a_replica_option_the_runtime_does_not_know_stops_the_launcher_with_its_name(iris_dir):
    answer = subprocess.run([sys.executable, "-m", "serving.runtime.launch", "--runtime", "pyfunc", "--model-dir",
                             str(iris_dir), "--model-name", "iris", "--config-json", '{"threads": 4}'],
                            capture_output=True, text=True, timeout=60)
    assert answer.returncode != 0 and "unknown replica option(s) threads" in answer.stderr
