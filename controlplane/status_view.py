"""What ``modelplane status`` shows, decided from plain data: no database, no HTTP, no terminal.

``controlplane.cli_status`` gathers the inputs (the control-plane stores, every live router's
``/metrics`` scraped twice) and hands them here; these functions return the rows of each table
as strings, so a test checks the exact output from fixed inputs.

Two views:

- endpoints (:data:`ENDPOINT_HEADERS`, :func:`endpoint_rows`): one row per endpoint, what serves
  it, its canary/shadow split, replicas ready of desired, requests/s and p99 against the SLO,
  the target concurrency per replica and where that number came from;
- revisions (:data:`REVISION_HEADERS`, :func:`revision_rows`): one row per live revision, its
  state, its share of the traffic and its replicas.

Requests/s and p99 come from the routers' Prometheus counters sampled twice (``sample_s``
apart): requests/s is the counter's increase over the sample, and p99 is estimated from the
latency histogram's buckets the way Prometheus's ``histogram_quantile`` does, over the answers
of the sample; with none in the sample, over every answer since the router started (marked
``*``). A bucket estimate is only as fine as the buckets (5, 10, 25, 50, 100, 250, 500 ms,
1, 2.5, 5, 10, 30, 60 s).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

ENDPOINT_HEADERS = ("endpoint", "serving", "split", "replicas", "req/s", "p99 ms", "SLO ms", "target",
                    "target source")
REVISION_HEADERS = ("endpoint", "revision", "version", "state", "traffic", "replicas")
SINCE_START_NOTE = "* p99 since the router started: no answers during the sample"
REQUESTS = "modelplane_router_requests_total"
LATENCY_BUCKET = "modelplane_router_request_latency_seconds_bucket"


@dataclass(frozen=True)
class Share:
    """A canary or shadow: which revision (and its version), what percent of requests."""

    revision_id: str
    version: str
    percent: float


@dataclass(frozen=True)
class Decision:
    """The newest vertical autoscaler decision: the target it set, its rule and reason."""

    target: float
    rule: str
    reason: str


@dataclass(frozen=True)
class Traffic:
    """One endpoint's requests/s and p99 over the sample (``p99_since_start``: over all answers instead)."""

    requests_per_s: float
    p99_ms: float | None
    p99_since_start: bool = False


@dataclass(frozen=True)
class EndpointStatus:
    name: str
    slo_p99_ms: float
    serving_revision: str | None = None  # None: no revision takes its traffic
    serving_version: str | None = None
    canary: Share | None = None
    shadow: Share | None = None
    ready_replicas: int = 0
    desired_replicas: int = 0
    traffic: Traffic | None = None  # None: no router answered
    target: float | None = None
    target_source: str = "-"


@dataclass(frozen=True)
class RevisionStatus:
    endpoint: str
    revision_id: str
    version: str
    state: str
    role: str | None = None  # serving | canary | shadow | None (takes no traffic)
    percent: float | None = None  # its share of requests (shadow: of requests copied to it)
    ready_replicas: int = 0
    desired_replicas: int = 0


@dataclass
class EndpointCounters:
    """One router's cumulative counters of one endpoint: requests, and latency buckets ``{le_s: count}``."""

    requests: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)


def version_of(partition_key: str) -> str:
    """``gec.v12`` → ``v12`` (the model version a revision serves).

    >>> version_of("gec.v12"), version_of("odd")
    ('v12', 'odd')
    """
    model, sep, version = partition_key.rpartition(".v")
    return f"v{version}" if sep and model else partition_key


def target_of(pinned: float | None, cost_model_target: float | None,
              decision: Decision | None) -> tuple[float, str]:
    """The per-replica target concurrency the autoscaler uses, and where it came from.

    The spec's ``scaling.target_concurrency`` pins it; else the vertical autoscaler's newest
    decision for the serving revision; else the cost model's (the revision's details); else 1,
    the autoscaler's own fallback (``autoscale.controller.sources.read_plans``).

    >>> target_of(None, 4, Decision(6, "slo-headroom", "p99 310 ms < 0.8 × 1000 ms SLO"))
    (6, 'autoscaler: slo-headroom — p99 310 ms < 0.8 × 1000 ms SLO')
    >>> target_of(None, 4, None)
    (4, 'cost model')
    >>> target_of(2, 4, None), target_of(None, None, None)
    ((2, 'spec (pinned)'), (1.0, 'default: no cost model yet'))
    """
    if pinned is not None:
        return pinned, "spec (pinned)"
    if decision is not None:
        return decision.target, f"autoscaler: {decision.rule} — {decision.reason}"
    if cost_model_target is not None:
        return cost_model_target, "cost model"
    return 1.0, "default: no cost model yet"


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of a cumulative histogram ``{upper bound: count}``, interpolated
    linearly inside its bucket as Prometheus's ``histogram_quantile`` does (None: no observations).

    100 answers, 50 under 0.1 s, 90 under 0.25 s, all under 0.5 s: the 99th is the 99th answer,
    9 of the 10 in (0.25, 0.5], so 0.25 + 0.25 × 9/10 = 0.475 s. One in the +Inf bucket gives the
    highest finite bound (the histogram cannot say more).

    >>> histogram_quantile(0.99, {0.1: 50, 0.25: 90, 0.5: 100, math.inf: 100})
    0.475
    >>> histogram_quantile(0.99, {0.1: 0, 60.0: 1, math.inf: 2})
    60.0
    >>> histogram_quantile(0.99, {0.1: 0, math.inf: 0}) is None
    True
    """
    ordered = sorted(buckets.items())
    total = ordered[-1][1] if ordered else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in ordered:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return round(lower + (upper - lower) * (rank - below) / (count - below), 9)
        lower, below = upper, count
    return lower


def parse_router_metrics(text: str) -> dict[str, EndpointCounters]:
    """A router's ``/metrics`` text → ``{endpoint: EndpointCounters}``; the ``-`` endpoint
    (requests to no known endpoint) is left out.

    >>> text = '''modelplane_router_requests_total{code="200",endpoint="gec"} 7.0
    ... modelplane_router_requests_total{code="503",endpoint="gec"} 1.0
    ... modelplane_router_requests_total{code="404",endpoint="-"} 3.0
    ... modelplane_router_request_latency_seconds_bucket{endpoint="gec",le="0.1"} 6.0
    ... modelplane_router_request_latency_seconds_bucket{endpoint="gec",le="+Inf"} 8.0
    ... '''
    >>> parse_router_metrics(text)
    {'gec': EndpointCounters(requests=8.0, buckets={0.1: 6.0, inf: 8.0})}
    """
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, EndpointCounters] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            endpoint = sample.labels.get("endpoint")
            if endpoint is None or endpoint == "-":
                continue
            if sample.name == REQUESTS:
                counters.setdefault(endpoint, EndpointCounters()).requests += sample.value
            elif sample.name == LATENCY_BUCKET:
                bound = float(sample.labels["le"])
                buckets = counters.setdefault(endpoint, EndpointCounters()).buckets
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return counters


def _increase(before: float, after: float) -> float:
    """A counter's increase; one that went down restarted (its router did), so all of ``after`` is new."""
    return after - before if after >= before else after


def traffic_by_endpoint(samples: Iterable[tuple[Mapping[str, EndpointCounters], Mapping[str, EndpointCounters],
                                                 float]]) -> dict[str, Traffic]:
    """Requests/s and p99 per endpoint from each router's two scrapes ``(before, after, elapsed_s)``.

    Routers add up: their request rates sum, their bucket counts sum before the quantile. Below,
    two routers answered 10 requests each in 2 s: 10 requests/s. Of the 20 answers 19 took under
    0.25 s, so the 99th (rank 19.8) lies in (0.25, 0.5]: 0.25 + 0.25 × 0.8/1 = 0.45 s.

    >>> inf = math.inf
    >>> a0 = {"gec": EndpointCounters(100, {0.25: 90, 0.5: 100, inf: 100})}
    >>> a1 = {"gec": EndpointCounters(110, {0.25: 99, 0.5: 110, inf: 110})}  # 10 answers, 9 under 0.25 s
    >>> b0 = {"gec": EndpointCounters(5, {0.25: 5, 0.5: 5, inf: 5})}
    >>> b1 = {"gec": EndpointCounters(15, {0.25: 15, 0.5: 15, inf: 15})}  # 10 answers, all under 0.25 s
    >>> traffic_by_endpoint([(a0, a1, 2.0), (b0, b1, 2.0)])
    {'gec': Traffic(requests_per_s=10.0, p99_ms=450.0, p99_since_start=False)}
    >>> traffic_by_endpoint([(a1, a1, 2.0)])  # none in the sample: p99 since start
    {'gec': Traffic(requests_per_s=0.0, p99_ms=475.0, p99_since_start=True)}
    """
    rates: dict[str, float] = {}
    window: dict[str, dict[float, float]] = {}
    since_start: dict[str, dict[float, float]] = {}
    for before, after, elapsed_s in samples:
        for endpoint, now in after.items():
            then = before.get(endpoint, EndpointCounters())
            rates[endpoint] = rates.get(endpoint, 0.0) + _increase(then.requests, now.requests) / max(elapsed_s, 1e-9)
            for bound, count in now.buckets.items():
                delta = _increase(then.buckets.get(bound, 0.0), count)
                window.setdefault(endpoint, {})[bound] = window.get(endpoint, {}).get(bound, 0.0) + delta
                since_start.setdefault(endpoint, {})[bound] = since_start.get(endpoint, {}).get(bound, 0.0) + count
    traffic = {}
    for endpoint in sorted(rates):
        p99_s = histogram_quantile(0.99, window.get(endpoint, {}))
        fallback = p99_s is None
        if fallback:
            p99_s = histogram_quantile(0.99, since_start.get(endpoint, {}))
        traffic[endpoint] = Traffic(round(rates[endpoint], 3), None if p99_s is None else round(1000 * p99_s, 3),
                                    fallback and p99_s is not None)
    return traffic


def _number(value: float) -> str:
    """A rate as a person reads it: whole above 10, one decimal above 1, two figures below.

    >>> _number(12.0), _number(3.456), _number(0.04)
    ('12', '3.5', '0.04')
    """
    if value >= 10 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def _share(share: Share | None, role: str) -> str | None:
    return None if share is None else f"{role} {share.version} {share.percent:g}%"


def p99_cell(traffic: Traffic | None, slo_p99_ms: float) -> str:
    """``p99 (over)`` or ``p99 (under)`` the SLO; ``*`` marks a p99 since the router started.

    >>> p99_cell(Traffic(3.0, 1450.0), 1000), p99_cell(Traffic(3.0, 412.4, True), 1000), p99_cell(None, 1000)
    ('1450 (over)', '412* (under)', '-')
    """
    if traffic is None or traffic.p99_ms is None:
        return "-"
    mark = "over" if traffic.p99_ms > slo_p99_ms else "under"
    return f"{traffic.p99_ms:.0f}{'*' if traffic.p99_since_start else ''} ({mark})"


def endpoint_rows(endpoints: Iterable[EndpointStatus]) -> list[tuple[str, ...]]:
    """One row per endpoint, by name, in the order of :data:`ENDPOINT_HEADERS`.

    >>> row, = endpoint_rows([EndpointStatus("gec", 1000.0, "gec-v2-1a2b3c4d", "v2",
    ...     canary=Share("gec-v3-5e6f7a8b", "v3", 10), ready_replicas=2, desired_replicas=3,
    ...     traffic=Traffic(12.5, 1450.0), target=4, target_source="cost model")])
    >>> row
    ('gec', 'gec-v2-1a2b3c4d (v2)', 'canary v3 10%', '2/3', '12', '1450 (over)', '1000', '4', 'cost model')
    """
    rows = []
    for e in sorted(endpoints, key=lambda e: e.name):
        if e.serving_revision is None:
            rows.append((e.name, "- (no revision serves it)", "-", "-", "-", "-", f"{e.slo_p99_ms:g}", "-", "-"))
            continue
        split = "; ".join(s for s in (_share(e.canary, "canary"), _share(e.shadow, "shadow")) if s) or "-"
        rows.append((e.name, f"{e.serving_revision} ({e.serving_version})", split,
                     f"{e.ready_replicas}/{e.desired_replicas}",
                     "-" if e.traffic is None else _number(e.traffic.requests_per_s),
                     p99_cell(e.traffic, e.slo_p99_ms), f"{e.slo_p99_ms:g}",
                     "-" if e.target is None else f"{e.target:g}", e.target_source))
    return rows


ROLE_ORDER = {"serving": 0, "canary": 1, "shadow": 2, None: 3}


def revision_rows(revisions: Iterable[RevisionStatus]) -> list[tuple[str, ...]]:
    """One row per revision: by endpoint, then serving, canary, shadow, the rest; in the order of
    :data:`REVISION_HEADERS`.

    >>> rows = revision_rows([RevisionStatus("gec", "gec-v3-5e6f7a8b", "v3", "ready", "canary", 10, 1, 1),
    ...                       RevisionStatus("gec", "gec-v2-1a2b3c4d", "v2", "serving", "serving", 90, 2, 3),
    ...                       RevisionStatus("gec", "gec-v1-0f0f0f0f", "v1", "draining", None, None, 1, 0)])
    >>> [r[1] + " " + r[4] for r in rows]
    ['gec-v2-1a2b3c4d serving 90%', 'gec-v3-5e6f7a8b canary 10%', 'gec-v1-0f0f0f0f -']
    """
    ordered = sorted(revisions, key=lambda r: (r.endpoint, ROLE_ORDER.get(r.role, 3), r.revision_id))
    rows = []
    for r in ordered:
        if r.role is None:
            traffic = "-"
        elif r.role == "shadow":
            traffic = f"shadow copy {r.percent:g}%"
        else:
            traffic = f"{r.role} {r.percent:g}%"
        rows.append((r.endpoint, r.revision_id, r.version, r.state, traffic,
                     f"{r.ready_replicas}/{r.desired_replicas}"))
    return rows
