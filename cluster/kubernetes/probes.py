"""``python -m cluster.kubernetes.probes live|drain``: a replica pod's liveness probe and preStop hook.

``live`` is the forward-progress check the local supervisor runs (``serving.runtime.liveness``),
as an exec probe: each run scrapes ``/metrics``, reads what the last run remembered from a
state file, calls the same pure ``decide``, sends the runtime's one-token probe request when
the replica has been idle too long, writes the state back and exits 1 only on HUNG. A
saturated replica whose counters move is never killed; a stopped engine is, within
``hang_after_s``, and a server that answers no scrape at all within ``unanswered_after_s``.

``drain`` is the preStop hook: it waits ``--settle-s`` for the routers to see the endpoint
terminating (they watch EndpointSlices), then until nothing is in flight or queued, at most
``--timeout-s``; Kubernetes sends SIGTERM after it, and the server finishes what is left.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

from serving.runtime.base import RuntimeConfig
from serving.runtime.liveness import LivenessConfig, LivenessState, Verdict, decide
from serving.runtime.registry import runtime_for

SCRAPE_TIMEOUT_S = 5.0


def read_state(path: str | Path) -> tuple[LivenessState, float | None]:
    """The last look's state and since when ``/metrics`` has gone unanswered (a fresh state if none)."""
    try:
        data = json.loads(Path(path).read_text())
        return LivenessState(**data["state"]), data.get("unanswered_since_s")
    except (OSError, ValueError, TypeError, KeyError):
        return LivenessState(), None


def write_state(path: Path, state: LivenessState, unanswered_since_s: float | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"state": asdict(state), "unanswered_since_s": unanswered_since_s}))
    tmp.replace(path)


def _get(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        return answer.read().decode()


def _post(url: str, body: dict, timeout_s: float) -> None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s):
        pass


def live(args: argparse.Namespace, now_s: float | None = None) -> int:
    runtime, config = runtime_for(args.runtime), LivenessConfig(**json.loads(args.liveness))
    base, state_path = f"http://127.0.0.1:{args.port}", Path(args.state)
    now_s = time.monotonic() if now_s is None else now_s
    state, unanswered_since_s = read_state(state_path)
    try:
        progress = runtime.progress(_get(f"{base}/metrics", SCRAPE_TIMEOUT_S))
    except (OSError, urllib.error.URLError) as exc:
        unanswered_since_s = unanswered_since_s if unanswered_since_s is not None else now_s
        write_state(state_path, state, unanswered_since_s)
        if now_s - unanswered_since_s >= config.unanswered_after_s:
            print(f"hung: /metrics unanswered for {config.unanswered_after_s:.0f} s ({exc})")
            return 1
        return 0
    probe = runtime.probe_request(Path(args.model_dir), RuntimeConfig(model_name=args.model_name))
    verdict, state = decide(progress, state, now_s, config, can_probe=probe is not None)
    write_state(state_path, state, None)
    if verdict is Verdict.HUNG:
        print("hung: work outstanding with no request completing")
        return 1
    if verdict is Verdict.PROBE:
        try:  # an unanswered probe shows as no completion at the next look
            _post(f"{base}{probe.path}", probe.json, args.probe_timeout_s)
        except (OSError, urllib.error.URLError):
            pass
    return 0


def drain(args: argparse.Namespace) -> int:
    runtime = runtime_for(args.runtime)
    time.sleep(args.settle_s)
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline:
        try:
            progress = runtime.progress(_get(f"http://127.0.0.1:{args.port}/metrics", SCRAPE_TIMEOUT_S))
        except (OSError, urllib.error.URLError):
            return 0  # the server is gone: nothing left to drain
        if progress.in_flight + progress.queued == 0:
            return 0
        time.sleep(0.5)
    print(f"drain: requests still in flight after {args.timeout_s:g} s; stopping anyway")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m cluster.kubernetes.probes")
    commands = top.add_subparsers(dest="command", required=True)
    for name in ("live", "drain"):
        sub = commands.add_parser(name)
        sub.add_argument("--runtime", required=True, choices=("vllm", "pyfunc"))
        sub.add_argument("--port", type=int, required=True)
    live_parser = commands.choices["live"]
    live_parser.add_argument("--model-dir", required=True)
    live_parser.add_argument("--model-name", required=True)
    live_parser.add_argument("--state", required=True)
    live_parser.add_argument("--probe-timeout-s", type=float, default=8.0, help="the probe request's HTTP timeout")
    live_parser.add_argument("--liveness", default="{}",
                             help="LivenessConfig's fields as JSON (the platform's MODELPLANE_LIVENESS_*); {}: defaults")
    drain_parser = commands.choices["drain"]
    drain_parser.add_argument("--settle-s", type=float, default=5.0)
    drain_parser.add_argument("--timeout-s", type=float, default=110.0)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return live(args) if args.command == "live" else drain(args)


if __name__ == "__main__":
    sys.exit(main())
