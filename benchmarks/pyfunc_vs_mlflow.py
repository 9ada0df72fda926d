"""modelplane's pyfunc server against ``mlflow models serve``: highest RPS at p99 ≤ 50 ms.

    .venv/bin/python -m benchmarks.pyfunc_vs_mlflow [--quick] --json OUT.json

All serve the demo iris model (scikit-learn LogisticRegression), logged to a throwaway MLflow
registry and downloaded as a replica would. Four servers run at once but only one is loaded at
a time: each concurrency level runs against each in turn, so that background load on a shared
machine falls on all alike. modelplane's batching is at its defaults (64 rows, 2 ms).

- **Headline, the fair anchor:** modelplane with 2 worker processes against
  ``mlflow models serve --workers 2``: both use both cores of this machine.
- modelplane's default (1 worker) against mlflow's default (``--workers 1``), what each user
  gets out of the box.
- **Two loads:** ``uniform`` (every request ``dataframe_split`` with one row, the same
  columns: batching's best case) and ``mixed`` (1 to 20 rows, and one request in four names the
  columns in another order, so fewer requests can share a predict call).

For each server and load, closed-loop concurrency steps up (1, 2, 4, ... 128) until p99
exceeds 50 ms or throughput stops growing (two levels in a row under 3 % above the best so
far); the figure is the highest throughput (rows per second for ``mixed``) of a level with
p99 ≤ 50 ms and no errors. The ratio at each concurrency both servers reached is reported
too (equal offered load). The load generator runs on the same machine and needs CPU too.

**Repeats** (``--repeats``, at least 3): the whole stepping runs again with the servers'
order reversed every other time, and every figure is min / median / max over the repeats
(``benchmarks.repeats``); ratios are taken within a repeat. **The goal counts every repeat,
both loads and every level:** modelplane with 2 workers at least 3 × mlflow with 2 workers in
its best throughput within the SLO, and at every concurrency both reached; one repeat, load or
level below that and the goal is not met (the report says which).
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
from benchmarks.repeats import spread
from serving.runtime.process import free_port

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
P99_SLO_MS = 50.0
MIN_GROWTH = 1.03
LEVELS = (1, 2, 4, 8, 16, 32, 64, 128)
COLUMNS = ["sepal length (cm)", "sepal width (cm)", "petal length (cm)", "petal width (cm)"]
REQUEST = {"dataframe_split": {"columns": COLUMNS, "data": [[5.1, 3.5, 1.4, 0.2]]}}
GOAL_RATIO = 3.0
GOAL = ("modelplane (2 workers) >= 3x mlflow models serve --workers 2 at p99 <= 50 ms: best throughput and at every "
        "equal concurrency, one-row and mixed requests, in every repeat")


def mixed_request(n: int) -> dict:
    """Request ``n`` of the mixed load: 1-20 rows; every fourth names the columns in reverse order.

    >>> len(mixed_request(6)["dataframe_split"]["data"]), mixed_request(3)["dataframe_split"]["columns"][0]
    (7, 'petal width (cm)')
    """
    rows = [[5.1 + (n % 7) * 0.1, 3.5, 1.4, 0.2]] * (1 + n % 20)
    if n % 4 == 3:
        return {"dataframe_split": {"columns": COLUMNS[::-1], "data": [row[::-1] for row in rows]}}
    return {"dataframe_split": {"columns": COLUMNS, "data": rows}}


LOADS = {"uniform": lambda n: REQUEST, "mixed": mixed_request}
ROWS = {"uniform": lambda n: 1, "mixed": lambda n: len(mixed_request(n)["dataframe_split"]["data"])}
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


def ours_command(model_dir: Path, port: int, workers: int = 1) -> tuple[list[str], dict[str, str]]:
    from serving.runtime.base import RuntimeConfig
    from serving.runtime.pyfunc import PyfuncRuntime

    launch = PyfuncRuntime().command(model_dir, "127.0.0.1", port, RuntimeConfig(model_name="iris", workers=workers))
    return launch.argv, launch.env


def mlflow_command(model_dir: Path, port: int, workers: int = 1) -> tuple[list[str], dict[str, str]]:
    # `mlflow models serve` starts `uvicorn` from PATH: the virtual environment's bin goes first.
    argv = [str(VENV_BIN / "mlflow"), "models", "serve", "-m", str(model_dir), "--env-manager", "local",
            "-h", "127.0.0.1", "-p", str(port), "--workers", str(workers)]
    return argv, {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


SERVERS = {  # name → (command, workers, description)
    "modelplane_2": (ours_command, 2, "modelplane pyfunc server, 2 workers"),
    "mlflow_2": (mlflow_command, 2, "mlflow models serve --workers 2"),
    "modelplane_1": (ours_command, 1, "modelplane pyfunc server, 1 worker (its default)"),
    "mlflow_1": (mlflow_command, 1, "mlflow models serve (its default: 1 worker)"),
}


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


def run_level(url: str, concurrency: int, load: str, *, duration_s: float, warmup_s: float) -> dict:
    result = closed_loop(f"{url}/invocations", LOADS[load], concurrency=concurrency, duration_s=duration_s,
                         warmup_s=warmup_s)
    summary = result.summary()
    mean_rows = sum(ROWS[load](n) for n in range(200)) / 200  # the request mix cycles through n
    summary["rows_per_s"] = round(summary["throughput_rps"] * mean_rows, 1)
    if result.errors:
        summary["error_samples"] = result.error_samples[:2]
    return summary


def shortfalls(comparison_by_repeat: list[dict[str, dict]], goal: float = GOAL_RATIO) -> list[str]:
    """Every (repeat, load, level) where the ratio is below ``goal``; [] when the goal is met.

    >>> shortfalls([{"uniform": {"ratio_best": 3.2, "ratio_at_equal_concurrency": {"1": 2.5, "2": 3.1}}}])
    ['repeat 1 uniform: 2.5x at concurrency 1']
    """
    missed = []
    for repeat, by_load in enumerate(comparison_by_repeat, 1):
        for load, comparison in by_load.items():
            if comparison["ratio_best"] < goal:
                missed.append(f"repeat {repeat} {load}: best {comparison['ratio_best']}x")
            missed += [f"repeat {repeat} {load}: {ratio}x at concurrency {level}"
                       for level, ratio in comparison["ratio_at_equal_concurrency"].items() if ratio < goal]
    return missed


def summarise(comparison_by_repeat: list[dict[str, dict]]) -> dict:
    """Per load: the best-throughput ratio and each level's ratio as min / median / max over repeats."""
    summary = {}
    for load in comparison_by_repeat[0]:
        runs = [by_load[load] for by_load in comparison_by_repeat]
        levels = sorted({level for run in runs for level in run["ratio_at_equal_concurrency"]}, key=int)
        summary[load] = {"ratio_best": spread([run["ratio_best"] for run in runs]),
                         "ours_best": spread([run["ours_best"] for run in runs]),
                         "anchor_best": spread([run["anchor_best"] for run in runs]),
                         "ratio_at_equal_concurrency": {
                             level: spread([run["ratio_at_equal_concurrency"][level] for run in runs
                                            if level in run["ratio_at_equal_concurrency"]]) for level in levels}}
    return summary


def step_up_alternating(servers: dict[str, Server], load: str, *, duration_s: float,
                        warmup_s: float) -> dict[str, list[dict]]:
    """Every concurrency level for each server back to back (all started, one loaded at a time),
    so that background load on a shared machine falls on all alike."""
    levels: dict[str, list[dict]] = {name: [] for name in servers}
    active = list(servers)
    for concurrency in LEVELS:
        for name in list(active):
            levels[name].append(run_level(servers[name].url, concurrency, load, duration_s=duration_s,
                                          warmup_s=warmup_s))
            log(f"  {load} {name}: {levels[name][-1]}")
            if should_stop(levels[name]):
                active.remove(name)
        if not active:
            break
    return levels


def compare(ours: list[dict], anchor: list[dict], key: str) -> dict:
    """Best within the SLO, and the ratio at every concurrency both reached (equal offered load)."""
    best_ours, best_anchor = best_level(ours), best_level(anchor)
    ours_best = best_ours[key] if best_ours else 0.0
    anchor_best = best_anchor[key] if best_anchor else 0.0
    anchor_by_c = {level["concurrency"]: level for level in anchor}
    at_equal = {str(level["concurrency"]): round(level[key] / anchor_by_c[level["concurrency"]][key], 3)
                for level in ours if level["concurrency"] in anchor_by_c and anchor_by_c[level["concurrency"]][key]}
    return {"ours_best": ours_best, "anchor_best": anchor_best,
            "ratio_best": round(ours_best / anchor_best, 3) if anchor_best else 0.0,
            "ratio_at_equal_concurrency": at_equal}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 s levels: a smoke run, not a measurement")
    parser.add_argument("--repeats", type=int, default=3, help="whole runs, the servers' order reversed every other")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3: one run of each side says nothing about the spread")
    duration_s, warmup_s = (3.0, 1.0) if args.quick else (10.0, 2.0)
    import mlflow

    with tempfile.TemporaryDirectory(prefix="pyfunc-bench-") as tmp:
        work = Path(tmp)
        model_dir = build_iris_model(work)
        servers: dict[str, Server] = {}
        argvs, ready_s = {}, {}
        runs: list[dict[str, dict[str, list[dict]]]] = []  # repeat → load → server → levels
        try:
            for name, (command, workers, _) in SERVERS.items():
                port = free_port()
                argvs[name], env = command(model_dir, port, workers)
                servers[name] = Server(argvs[name], env, work / f"{name}.log", port)
                ready_s[name] = servers[name].wait_healthy()  # one at a time: startup is measured alone
                log(f"{name}: healthy after {ready_s[name]:.1f} s")
                for n in range(40):  # first requests pay one-off costs (imports, caches)
                    httpx.post(f"{servers[name].url}/invocations", json=LOADS["mixed"](n), timeout=30).raise_for_status()
            for repeat in range(args.repeats):
                order = list(servers) if repeat % 2 == 0 else list(reversed(servers))
                log(f"repeat {repeat + 1}/{args.repeats}: {', '.join(order)}")
                runs.append({load: step_up_alternating({name: servers[name] for name in order}, load,
                                                       duration_s=duration_s, warmup_s=warmup_s) for load in LOADS})
        finally:
            for server in servers.values():
                server.stop()

    def report(name: str) -> dict:
        return {"server": SERVERS[name][2], "command": " ".join(argvs[name]), "workers": SERVERS[name][1],
                "startup_to_healthy_s": round(ready_s[name], 1),
                "levels_by_repeat": [{load: run[load][name] for load in LOADS} for run in runs],
                "best_by_repeat": [{load: best_level(run[load][name]) for load in LOADS} for run in runs]}

    by_repeat = {f"{ours}_vs_{anchor}": [{load: compare(run[load][ours], run[load][anchor],
                                                        "throughput_rps" if load == "uniform" else "rows_per_s")
                                          for load in LOADS} for run in runs]
                 for ours, anchor in (("modelplane_2", "mlflow_2"), ("modelplane_1", "mlflow_1"))}
    headline = by_repeat["modelplane_2_vs_mlflow_2"]
    missed = shortfalls(headline)
    ours = {**report("modelplane_2"), "default_one_worker": report("modelplane_1"),
            "comparisons": {pair: summarise(runs_of_pair) for pair, runs_of_pair in by_repeat.items()},
            "comparisons_by_repeat": by_repeat, "goal_shortfalls": missed,
            "settings": {"p99_slo_ms": P99_SLO_MS, "level_duration_s": duration_s, "level_warmup_s": warmup_s,
                         "repeats": args.repeats, "quick": args.quick, "mlflow": mlflow.__version__,
                         "note": "levels alternate between the servers within a repeat, and the servers' order "
                                 "reverses every other repeat; the load generator (aiohttp) runs on the same machine"}}
    anchor = {**report("mlflow_2"), "default_one_worker": report("mlflow_1")}
    anchor_missing = [i + 1 for i, run in enumerate(headline) if not all(c["anchor_best"] for c in run.values())]
    reason = (f"mlflow --workers 2 held no level within the SLO without errors in repeat(s) {anchor_missing}"
              if anchor_missing else "; ".join(missed) or None)
    ratio = summarise(headline)["uniform"]["ratio_best"]["median"]
    return write_result(args.json, benchmark="pyfunc_vs_mlflow", ours=ours, anchor=anchor, ratio=ratio,
                        goal=GOAL, meets_goal=not missed and not anchor_missing, unmet_reason=reason)


if __name__ == "__main__":
    main()
