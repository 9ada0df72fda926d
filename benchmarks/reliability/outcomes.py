"""What became of each request of a fault's request loop, and what a fault's run adds up to.

A request ends in exactly one of four ways:

- ``ok``: a 2xx answer;
- ``refused``: a 429 or 503 that carries ``Retry-After`` (the platform said "not now, come
  back then", which a client can act on);
- ``failed``: any other answer, or an error that ended the request before its deadline
  (connection refused or reset);
- ``lost``: no answer within the client's deadline (the request hung).

Pure functions and plain records: the request loop (``requestloop``) writes one JSON line per
request, the scenarios (``faults``) read them back and judge them against the fault's
required result.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

OUTCOMES = ("ok", "refused", "failed", "lost")


def classify(status: int | None, headers: Mapping[str, str] | None = None, *, timed_out: bool = False) -> str:
    """The outcome of one request: its status (None: no answer) and its answer's headers."""
    if timed_out:
        return "lost"
    if status is None:
        return "failed"
    if 200 <= status < 300:
        return "ok"
    if status in (429, 503) and any(name.lower() == "retry-after" for name in (headers or {})):
        return "refused"
    return "failed"


@dataclass(frozen=True)
class Record:
    """One request of a loop: when it was sent (wall clock, s), how long it took, its status
    (0: no answer), its outcome, how many attempts the client made, and the first bytes of a
    failure's answer or its exception."""

    sent_s: float
    latency_s: float
    status: int
    outcome: str
    attempts: int = 1
    detail: str = ""

    @classmethod
    def from_json(cls, data: Mapping) -> "Record":
        return cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})


@dataclass(frozen=True)
class Tally:
    sent: int
    ok: int
    refused: int
    failed: int
    lost: int
    max_latency_s: float
    first_bad_s: float | None  # wall-clock send time of the first failed or lost request
    last_bad_s: float | None

    @classmethod
    def of(cls, records: Iterable[Record]) -> "Tally":
        records = list(records)
        counts = Counter(record.outcome for record in records)
        unknown = set(counts) - set(OUTCOMES)
        if unknown:
            raise ValueError(f"unknown outcomes {sorted(unknown)}; known: {', '.join(OUTCOMES)}")
        bad = sorted(r.sent_s for r in records if r.outcome in ("failed", "lost"))
        return cls(sent=len(records), ok=counts["ok"], refused=counts["refused"], failed=counts["failed"],
                   lost=counts["lost"], max_latency_s=max((r.latency_s for r in records), default=0.0),
                   first_bad_s=bad[0] if bad else None, last_bad_s=bad[-1] if bad else None)

    def failure_rate(self) -> float:
        return (self.failed + self.lost) / self.sent if self.sent else 0.0


@dataclass
class FaultResult:
    """One row of the reliability table: the fault, what it must achieve, what it did.

    ``detect_s``: fault to the platform noticing it (a replica marked unhealthy, a service
    restarted, an error answered); ``recover_s``: fault to full service again (as many ready
    replicas as before, the service back). None where the fault has no such moment."""

    fault: str
    required: str
    passed: bool
    sent: int = 0
    ok: int = 0
    refused: int = 0
    failed: int = 0
    lost: int = 0
    detect_s: float | None = None
    recover_s: float | None = None
    checks: dict[str, bool] = field(default_factory=dict)  # each part of the requirement, judged
    notes: str = ""

    @classmethod
    def judged(cls, fault: str, required: str, tally: Tally | None, checks: dict[str, bool], *,
               detect_s: float | None = None, recover_s: float | None = None, notes: str = "") -> "FaultResult":
        counts = {} if tally is None else {name: getattr(tally, name) for name in ("sent", "ok", "refused", "failed",
                                                                                     "lost")}
        return cls(fault=fault, required=required, passed=bool(checks) and all(checks.values()), checks=checks,
                   detect_s=None if detect_s is None else round(detect_s, 1),
                   recover_s=None if recover_s is None else round(recover_s, 1), notes=notes, **counts)

    def as_dict(self) -> dict:
        return asdict(self)

    def explain(self) -> str:
        """For an assertion message: the checks that failed, the counts and the notes."""
        failing = [name for name, ok in self.checks.items() if not ok] or ["(no check ran)"]
        return (f"{self.fault}: failed {', '.join(failing)}; sent {self.sent}, ok {self.ok}, refused {self.refused}, "
                f"failed {self.failed}, lost {self.lost}, detect {self.detect_s}, recover {self.recover_s}; {self.notes}")
