"""modelplane's pyfunc server against ``mlflow models serve``: highest RPS at p99 ≤ 50 ms.

    .venv/bin/python -m benchmarks.pyfunc_vs_mlflow [--quick] --json OUT.json

Both serve the demo iris model (scikit-learn LogisticRegression), logged to a throwaway MLflow
registry and downloaded as a replica would. Both servers run at once but only one is loaded at
a time: each concurrency level runs against one, then the other, so that background load on a
shared machine falls on both alike. Each has **one worker process**: ``mlflow models serve``'s
default (``--workers 1``, what a user gets) and modelplane's default, so the comparison is per
process; the load generator runs on the same machine and needs CPU too. modelplane's batching is at its defaults
(64 rows, 2 ms). The request is the same for both: ``dataframe_split`` with one row.

For each server, closed-loop concurrency steps up (1, 2, 4, ... 128) until p99 exceeds 50 ms
or throughput stops growing (two levels in a row under 3 % above the best so far); the
server's figure is the highest throughput of a level with p99 ≤ 50 ms and no errors.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.loadgen import closed_loop
from benchmarks.machine import write_result
from serving.runtime.process import free_port

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
P99_SLO_MS = 50.0
MIN_GROWTH = 1.03
LEVELS = (1, 2, 4, 8, 16, 32, 64, 128)
COLUMNS = ["sepal length (cm)", "sepal width (cm)", "petal length (cm)", "petal width (cm)"]
REQUEST = {"dataframe_split": {"columns": COLUMNS, "data": [[5.1, 3.5, 1.4, 0.2]]}}
OFFLINE_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}


def build_iris_model(root: Path) -> Path:
    """Log the demo iris model to an MLflow registry under ``root`` and download it as a replica would."""
    from mlflow import MlflowClient

    from demo.iris import log_iris
    from pipelines.registry import MlflowRegistry

    uri = f"sqlite:///{root / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).create_experiment("modelplane-demo", artifact_location=(root / "artifacts").as_uri())
    log_iris(uri)
    return MlflowRegistry(uri).download("iris", "1", root / "model")


def ours_command(model_dir: Path, port: int) -> tuple[list[str], dict[str, str]]:
    from serving.runtime.base import RuntimeConfig
    from serving.runtime.pyfunc import PyfuncRuntime

    launch = PyfuncRuntime().command(model_dir, "127.0.0.1", port, RuntimeConfig(model_name="iris", workers=1))
    return launch.argv, launch.env


def mlflow_command(model_dir: Path, port: int) -> tuple[list[str], dict[str, str]]:
    # `mlflow models serve` starts `uvicorn` from PATH: the virtual environment's bin goes first.
    argv = [str(VENV_BIN / "mlflow"), "models", "serve", "-m", str(model_dir), "--env-manager", "local",
            "-h", "127.0.0.1", "-p", str(port)]
    return argv, {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


class Server:
    """A server process in its own session, so that stopping it stops its children (mlflow's uvicorn)."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **OFFLINE_ENV, **env}, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 180.0) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited ({self.process.returncode}): {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not healthy after {timeout_s} s: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the group this script started
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def should_stop(levels: list[dict], slo_ms: float = P99_SLO_MS) -> bool:
    """Stop stepping when the last level broke the SLO or had errors, or when the last two levels
    both failed to beat the best level before them by 3 % (one flat level can be noise, or the
    two-client lockstep in which each request is predicted alone).

    >>> should_stop([{"throughput_rps": 100, "p99_ms": 5}, {"throughput_rps": 150, "p99_ms": 60}])
    True
    >>> should_stop([{"throughput_rps": 100, "p99_ms": 5}, {"throughput_rps": 102, "p99_ms": 6}])
    False
    >>> should_stop([{"throughput_rps": 100, "p99_ms": 5}, {"throughput_rps": 102, "p99_ms": 6},
    ...              {"throughput_rps": 101, "p99_ms": 9}])
    True
    """
    last = levels[-1]
    if last["p99_ms"] > slo_ms or last.get("errors"):
        return True
    rps = [level["throughput_rps"] for level in levels]
    stalled = [i for i in range(1, len(rps)) if rps[i] < MIN_GROWTH * max(rps[:i])]
    return len(rps) >= 3 and stalled[-2:] == [len(rps) - 2, len(rps) - 1]


def best_level(levels: list[dict], slo_ms: float = P99_SLO_MS) -> dict | None:
    """The level with the highest throughput among those within the SLO and without errors."""
    within = [level for level in levels if level["p99_ms"] <= slo_ms and not level.get("errors")]
    return max(within, key=lambda level: level["throughput_rps"], default=None)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_level(url: str, concurrency: int, *, duration_s: float, warmup_s: float) -> dict:
    result = closed_loop(f"{url}/invocations", lambda n: REQUEST, concurrency=concurrency, duration_s=duration_s,
                         warmup_s=warmup_s)
    summary = result.summary()
    if result.errors:
        summary["error_samples"] = result.error_samples[:2]
    return summary


def step_up_alternating(servers: dict[str, Server], *, duration_s: float, warmup_s: float) -> dict[str, list[dict]]:
    """Every concurrency level for each server back to back (both started, one loaded at a time),
    so that background load on a shared machine falls on both alike."""
    levels: dict[str, list[dict]] = {name: [] for name in servers}
    active = list(servers)
    for concurrency in LEVELS:
        for name in list(active):
            levels[name].append(run_level(servers[name].url, concurrency, duration_s=duration_s, warmup_s=warmup_s))
            log(f"  {name}: {levels[name][-1]}")
            if should_stop(levels[name]):
                active.remove(name)
        if not active:
            break
    return levels


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 s levels: a smoke run, not a measurement")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    duration_s, warmup_s = (3.0, 1.0) if args.quick else (10.0, 2.0)
    import mlflow

    commands = {"modelplane": ours_command, "mlflow": mlflow_command}
    with tempfile.TemporaryDirectory(prefix="pyfunc-bench-") as tmp:
        work = Path(tmp)
        model_dir = build_iris_model(work)
        servers: dict[str, Server] = {}
        argvs, ready_s = {}, {}
        try:
            for name, command in commands.items():
                port = free_port()
                argvs[name], env = command(model_dir, port)
                servers[name] = Server(argvs[name], env, work / f"{name}.log", port)
                ready_s[name] = servers[name].wait_healthy()  # one at a time: startup is measured alone
                log(f"{name}: healthy after {ready_s[name]:.1f} s")
                for _ in range(20):  # first requests pay one-off costs (imports, caches)
                    httpx.post(f"{servers[name].url}/invocations", json=REQUEST, timeout=30).raise_for_status()
            levels = step_up_alternating(servers, duration_s=duration_s, warmup_s=warmup_s)
        finally:
            for server in servers.values():
                server.stop()

    def report(name: str, server: str) -> dict:
        return {"server": server, "command": " ".join(argvs[name]), "workers": 1,
                "startup_to_healthy_s": round(ready_s[name], 1), "levels": levels[name],
                "best": best_level(levels[name])}

    ours = report("modelplane", "modelplane pyfunc server (uvicorn+uvloop+httptools, raw ASGI, msgspec, "
                                "micro-batching 64 rows / 2 ms)")
    anchor = report("mlflow", f"mlflow models serve {mlflow.__version__} (its defaults: 1 uvicorn worker, FastAPI)")
    ours_rps = ours["best"]["throughput_rps"] if ours["best"] else 0.0
    anchor_rps = anchor["best"]["throughput_rps"] if anchor["best"] else 0.0
    ratio = ours_rps / anchor_rps if anchor_rps else float("inf")
    ours["settings"] = {"request": "dataframe_split, 1 row (iris)", "p99_slo_ms": P99_SLO_MS,
                        "level_duration_s": duration_s, "level_warmup_s": warmup_s, "quick": args.quick,
                        "note": "levels alternate between the two servers; the load generator (aiohttp) runs on "
                                "the same machine"}
    return write_result(args.json, benchmark="pyfunc_vs_mlflow", ours=ours, anchor=anchor, ratio=ratio,
                        goal="≥ 3× mlflow models serve RPS at p99 ≤ 50 ms", meets_goal=ratio >= 3)


if __name__ == "__main__":
    main()
