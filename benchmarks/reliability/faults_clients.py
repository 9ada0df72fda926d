"""Faults that clients cause: a flood of bad requests and a flood of unknown tokens beside
another client's good traffic. Neither may count against the replicas (no ejection, no
restart, no rollback) or cost the good client a request, or cost the control-plane database
more transactions than its idle level (``iris`` logs every request, the refused ones too: the
routers' inference-log writes must stay batched, one a second each, however fast records come).

Each flood is closed-loop clients that send as fast as they are answered
(:class:`~benchmarks.reliability.load.RequestLoop` with no pause), so the rate they reach is
what the routers answer on this machine; the row's notes give it, and the good client's p99
before and during the flood. That p99 is measured, not judged: on one machine the flooding
clients share the cores with the routers and replicas, so their load slows the good client
whatever the platform does with their requests (docs/reliability.md gives the figures).
"""

from __future__ import annotations

import contextlib
import time

from sqlalchemy import text

from benchmarks.reliability.bed import FaultBed
from benchmarks.reliability.faults_control import routers_total
from benchmarks.reliability.load import RequestLoop, Target
from benchmarks.reliability.outcomes import FaultResult, Record, Tally
from benchmarks.reliability.platform import IRIS_REQUEST

DB_SLACK_PER_S = 1.0  # transactions a second the database may take above 1.2× its idle level (stats' noise)
BAD_REQUEST_CLIENTS = 6  # closed-loop clients per flooding process of bad bodies
# An unknown token's request is answered once a table read after it came in found no such
# token (at most one read per router each ``unknown_token_reread_s``): its clients wait there,
# and more of them are needed to offer the routers hundreds of tokens a second.
BAD_TOKEN_CLIENTS = 100
_COLUMNS = IRIS_REQUEST["dataframe_split"]["columns"]
# What a buggy client sends iris: each fails the model's signature or MLflow's input format (400).
BAD_BODIES = {
    "unknown columns": {"dataframe_split": {"columns": ["a", "b"], "data": [[1.0, 2.0]]}},
    "strings for floats": {"dataframe_split": {"columns": _COLUMNS, "data": [["x", "y", "z", "w"]]}},
    "no input format": {"rows": [[5.1, 3.5, 1.4, 0.2]]},
}


def p99_s(records: list[Record]) -> float | None:
    """The 99th percentile latency of the answered requests (nearest rank), None without any.

    >>> p99_s([Record(0.0, i / 100, 200, "ok") for i in range(1, 101)])
    0.99
    """
    latencies = sorted(r.latency_s for r in records if r.outcome == "ok")
    if not latencies:
        return None
    return latencies[max(0, -(-99 * len(latencies) // 100) - 1)]


def _ejections(bed: FaultBed, endpoint: str) -> float:
    """Outlier ejections of ``endpoint``'s replicas so far, summed over the routers."""
    return routers_total(bed, ("modelplane_router_ejections_total",), endpoint=endpoint)


def _transactions(bed: FaultBed) -> float:
    """Transactions the platform's database has run so far (PostgreSQL's own count)."""
    with bed.engine.connect() as connection:
        connection.execute(text("SET stats_fetch_consistency = none"))
        return float(connection.execute(text(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = :name"),
            {"name": bed.database}).scalar_one())


def _window(bed: FaultBed, name: str, duration_s: float, floods: list[Target], clients: int) -> dict:
    """A good loop on iris for ``duration_s`` beside ``floods`` (none: the baseline): the good
    requests sent in the window, the floods' records, the database's transactions a second."""
    with contextlib.ExitStack() as stack:
        good = stack.enter_context(RequestLoop(bed.targets["iris"], bed.work / f"{name}-good.jsonl"))
        flooding = [stack.enter_context(RequestLoop(target, bed.work / f"{name}-flood-{i}.jsonl",
                                                    concurrency=clients, pause_s=0.0, deadline_s=30))
                    for i, target in enumerate(floods)]
        time.sleep(2)  # every loop at its pace
        began_wall, began, transactions = time.time(), time.monotonic(), _transactions(bed)
        time.sleep(duration_s)
        ended_wall, took_s = time.time(), time.monotonic() - began
        per_s = (_transactions(bed) - transactions) / took_s
    window = [r for r in good.records() if began_wall <= r.sent_s <= ended_wall]
    flood_records = [r for loop in flooding for r in loop.records() if began_wall <= r.sent_s <= ended_wall]
    return {"good": window, "good_tally": good.tally(), "flood": flood_records, "flood_per_s": len(flood_records) / took_s,
            "transactions_per_s": per_s, "p99_s": p99_s(window)}


def _judged_flood(bed: FaultBed, fault: str, required: str, name: str, duration_s: float, floods: list[Target],
                  clients: int, answer_ok) -> FaultResult:
    before = bed.serving("iris")
    replicas = {r.replica_id: (r.pid, r.restarts) for r in bed.replicas("iris")}
    ejections = _ejections(bed, "iris")
    base = _window(bed, f"{name}-baseline", duration_s, [], clients)
    flood = _window(bed, name, duration_s, floods, clients)
    ejected = _ejections(bed, "iris") - ejections
    after = {r.replica_id: (r.pid, r.restarts) for r in bed.replicas("iris")}
    statuses = sorted({r.status for r in flood["flood"]})
    wrong = [r for r in flood["flood"] if not answer_ok(r)]
    tally = flood["good_tally"]
    ratio = (flood["p99_s"] / base["p99_s"]) if base["p99_s"] and flood["p99_s"] else None
    db_limit = base["transactions_per_s"] * 1.2 + DB_SLACK_PER_S
    checks = {
        "the flood was answered (some requests sent)": bool(flood["flood"]),
        "each flooding request refused with a 4xx and a reason, none a 5xx": not wrong,
        "0 replicas ejected": ejected == 0,
        "no replica restarted or replaced": after == replicas,
        "0 rollbacks (the same revision serves)": bed.serving("iris") == before,
        "the good client lost nothing": tally.sent > 0 and tally.failed == tally.lost == tally.refused == 0,
        "the database at its idle level (at most 1.2x + 1 transaction/s)": flood["transactions_per_s"] <= db_limit}
    return FaultResult.judged(
        fault, required, tally, checks,
        notes=f"{len(floods)} flooding processes of {clients} clients: {flood['flood_per_s']:.0f} requests/s "
              f"for {duration_s:g} s, statuses {statuses}; good p99 {_ms(base['p99_s'])} before, {_ms(flood['p99_s'])} "
              f"during ({'-' if ratio is None else f'{ratio:.2f}'}x, {len(base['good'])} and {len(flood['good'])} "
              f"requests); database {base['transactions_per_s']:.1f} transactions/s before, "
              f"{flood['transactions_per_s']:.1f} during; {ejected:g} ejections"
              + (f"; wrong answers: {sorted({(r.status, r.detail[:80]) for r in wrong})[:3]}" if wrong else ""))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def bad_requests(bed: FaultBed, duration_s: float = 60.0) -> FaultResult:
    """Clients sending iris bodies its signature or MLflow's format refuses, as fast as they are
    answered, for ``duration_s``, beside a good client; judged against the same good client's
    ``duration_s`` just before."""
    good = bed.targets["iris"]
    floods = [Target(f"bad: {kind}", good.url, body, good.headers) for kind, body in BAD_BODIES.items()]
    return _judged_flood(
        bed, "a flood of bad requests beside good traffic",
        "0 ejections, 0 restarts, 0 rollbacks; every bad request a 4xx with its reason; the database at its idle "
        "level; the good client loses nothing",
        "bad-requests", duration_s, floods, BAD_REQUEST_CLIENTS,
        lambda r: 400 <= r.status < 500 and bool(r.detail.strip()))


def bad_tokens(bed: FaultBed, duration_s: float = 60.0) -> FaultResult:
    """Clients sending iris a new unknown token in every request (the negative cache's worst
    case), as fast as they are answered, for ``duration_s``, beside a good client."""
    good = bed.targets["iris"]
    floods = [Target("bad token", good.url, good.body, {"Authorization": "Bearer mp-{random}"})
              for _ in range(2)]
    return _judged_flood(
        bed, "a flood of unknown tokens beside good traffic",
        "the database at its idle level; every request a 401; 0 ejections, 0 restarts; the good client loses nothing",
        "bad-tokens", duration_s, floods, BAD_TOKEN_CLIENTS, lambda r: r.status == 401)
