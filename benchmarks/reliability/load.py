"""The request loop (``requestloop``) as a context manager around a fault.

    with RequestLoop(endpoint, work_dir / "kill.jsonl") as loop:
        ...  # inject the fault, wait for recovery
    tally = loop.tally()

Entering starts the loop's process and returns once its first request was answered;
leaving sends SIGTERM and waits for the requests in flight (each ends by its deadline).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.polling import wait_for
from benchmarks.reliability.outcomes import Record, Tally


@dataclass(frozen=True)
class Target:
    """Where a loop sends its requests: a URL, the JSON body and the headers (the bearer token)."""

    name: str
    url: str
    body: dict
    headers: dict[str, str] = field(default_factory=dict)


class RequestLoop:
    def __init__(self, target: Target, out: Path, *, concurrency: int = 4, pause_s: float = 0.02,
                 deadline_s: float = 30.0, retries: int = 0) -> None:
        self.target, self.out = target, out
        self.deadline_s, self.retries = deadline_s, retries
        self._argv = [sys.executable, "-m", "benchmarks.reliability.requestloop", "--url", target.url,
                      "--body", json.dumps(target.body), "--out", str(out), "--concurrency", str(concurrency),
                      "--pause-s", str(pause_s), "--deadline-s", str(deadline_s), "--retries", str(retries),
                      *[a for name, value in target.headers.items() for a in ("--header", f"{name}: {value}")]]
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "RequestLoop":
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text("")
        self._process = subprocess.Popen(self._argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         cwd=Path(__file__).resolve().parent.parent.parent)
        try:
            wait_for(lambda: self.records() or self._process.poll() is not None, 60, "the request loop's first answer")
        except AssertionError:
            self.stop()
            raise
        if self._process.poll() is not None:
            raise RuntimeError(f"the request loop exited: {self._process.stderr.read().decode()[-2000:]}")
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(timeout=self.deadline_s * (self.retries + 1) + 30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def records(self) -> list[Record]:
        lines = self.out.read_text().splitlines() if self.out.exists() else []
        return [Record.from_json(json.loads(line)) for line in lines if line.strip()]

    def tally(self, since_s: float | None = None) -> Tally:
        """Every request so far (or those sent at or after ``since_s``, wall clock)."""
        return Tally.of(r for r in self.records() if since_s is None or r.sent_s >= since_s)



def until(predicate, timeout_s: float, interval_s: float = 0.2, since: float | None = None) -> float | None:
    """Seconds until ``predicate()`` was first true (polled every ``interval_s``), counted from
    ``since`` (a ``time.monotonic()`` reading; default: now), None if it was not within
    ``timeout_s``: for measuring a moment, where ``wait_for`` would fail."""
    started = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - (started if since is None else since)
        except Exception:  # noqa: BLE001 - a probe that errs (a service restarting) is "not yet"
            pass
        if time.monotonic() - started >= timeout_s:
            return None
        time.sleep(interval_s)
