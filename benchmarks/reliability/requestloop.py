"""A steady request loop in a process of its own, counting every request's outcome.

    python -m benchmarks.reliability.requestloop --url URL --body JSON --out FILE.jsonl \\
        [--header "Authorization: Bearer …"] [--concurrency 4] [--pause-s 0.02] \\
        [--deadline-s 30] [--retries 0] [--duration-s S]

``concurrency`` closed-loop clients send ``body`` to ``url`` until SIGTERM (or for
``duration-s``), each with its own keep-alive connection, and append one JSON line per request
to ``--out`` (``outcomes.Record``), flushed at once, so that what was counted survives this
process being killed. A request with no answer after ``deadline-s`` is ``lost``. With
``--retries N`` a client retries a request that got no answer at all (connection refused or
reset) or a 502/503, up to N times, 0.1 s apart: what a client behind a load balancer does.
A header value may hold ``{random}``, replaced by a new random hex string in every request
(a client that never sends the same unknown token twice). On SIGTERM the loop stops sending and waits for the requests in flight (each ends by its
deadline), then exits.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx

from benchmarks.reliability.outcomes import Record, classify

RETRIED_STATUSES = (502, 503)


def fresh(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` with each ``{random}`` replaced by a new random hex string.

    >>> one, two = fresh({"Authorization": "Bearer {random}"}), fresh({"Authorization": "Bearer {random}"})
    >>> one != two and one["Authorization"].startswith("Bearer ") and "{" not in one["Authorization"]
    True
    """
    return {name: value.replace("{random}", uuid.uuid4().hex) if "{random}" in value else value
            for name, value in headers.items()}


def one_request(client: httpx.Client, url: str, body: bytes, headers: dict[str, str], retries: int) -> Record:
    sent_s, started = time.time(), time.monotonic()
    headers = fresh(headers)
    attempts = 0
    while True:
        attempts += 1
        try:
            response = client.post(url, content=body, headers=headers)
        except httpx.TimeoutException as exc:
            return Record(sent_s, time.monotonic() - started, 0, classify(None, timed_out=True), attempts,
                          repr(exc)[:200])
        except httpx.TransportError as exc:
            if attempts <= retries:
                time.sleep(0.1)
                continue
            return Record(sent_s, time.monotonic() - started, 0, classify(None), attempts, repr(exc)[:200])
        if response.status_code in RETRIED_STATUSES and attempts <= retries:
            time.sleep(0.1)
            continue
        outcome = classify(response.status_code, response.headers)
        detail = "" if outcome == "ok" else response.text[:200]
        return Record(sent_s, time.monotonic() - started, response.status_code, outcome, attempts, detail)


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    headers = {"Content-Type": "application/json"}
    for header in args.header:
        name, _, value = header.partition(":")
        headers[name.strip()] = value.strip()
    body = args.body.encode()
    lock = threading.Lock()
    out = Path(args.out).open("a", buffering=1)

    def client_loop() -> None:
        with httpx.Client(timeout=httpx.Timeout(args.deadline_s, connect=min(5.0, args.deadline_s))) as client:
            while not stop.is_set():
                record = one_request(client, args.url, body, headers, args.retries)
                with lock:
                    out.write(json.dumps(record.__dict__) + "\n")
                stop.wait(args.pause_s)

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(args.concurrency)]
    for thread in threads:
        thread.start()
    print("request loop running", flush=True)
    stop.wait(args.duration_s)
    stop.set()
    for thread in threads:
        thread.join(args.deadline_s * (args.retries + 1) + 5)
    out.close()
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--body", required=True, help="the JSON body sent with every request")
    parser.add_argument("--out", required=True, help="JSON lines, one per request")
    parser.add_argument("--header", action="append", default=[],
                        help="NAME: VALUE (repeatable; {random}: new in every request)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pause-s", type=float, default=0.02, help="each client's pause between requests")
    parser.add_argument("--deadline-s", type=float, default=30.0, help="a request with no answer by then is lost")
    parser.add_argument("--retries", type=int, default=0, help="retries of an unanswered request or a 502/503")
    parser.add_argument("--duration-s", type=float, default=None, help="stop after this long (default: SIGTERM)")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.deadline_s <= 0 or args.retries < 0 or args.pause_s < 0:
        parser.error("--concurrency must be ≥ 1, --deadline-s > 0, --retries and --pause-s ≥ 0")
    return args


if __name__ == "__main__":
    raise SystemExit(run(parse()))
