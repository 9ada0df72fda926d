"""Prometheus for ``modelplane up --prometheus``: its configuration, written from code, and its start.

``python -m controlplane.prometheus --port N`` (a service of ``up``) writes
``$MODELPLANE_HOME/prometheus/prometheus.yml`` and ``rules.yml`` and then becomes Debian's
``/usr/bin/prometheus`` (``exec``: the same process, so ``up`` stops and restarts it like
any other service, and a restart rewrites the configuration). It listens on 127.0.0.1 only,
whatever ``MODELPLANE_HOST`` says (Prometheus has no authentication), and keeps its TSDB in
``prometheus/data``.

What it scrapes comes from files (``file_sd_configs``) that ``controlplane.prometheus_targets``
rewrites as routers and replicas come and go; Prometheus notices a changed file by itself.
Scrapes and rule evaluations run every 5 s, so a recording rule has values within seconds of
the first requests and the 1-minute rates span 12 scrapes. The recording rules, the alerting
rules and the metrics they read are documented in docs/metrics.md. Prometheus evaluates the
alerts and shows them at ``/alerts``; sending them on is Alertmanager's job, which ``up`` does
not start (point ``alerting:`` of a Prometheus of your own at one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

SCRAPE_INTERVAL_S = 5
SCRAPE_TIMEOUT_S = 4  # must not exceed the interval
EVALUATION_INTERVAL_S = 5
ROUTERS_FILE, REPLICAS_FILE, CONTROL_PLANE_FILE = "routers.json", "replicas.json", "control-plane.json"
#: scrape job → the targets file (under ``prometheus/targets``) that lists its targets
TARGET_FILES = {"modelplane-router": ROUTERS_FILE, "modelplane-replica": REPLICAS_FILE,
                "modelplane-control-plane": CONTROL_PLANE_FILE}


@dataclass(frozen=True)
class RecordingRule:
    record: str
    expr: str
    meaning: str


#: Evaluated in order, each every ``EVALUATION_INTERVAL_S``; a later rule may read an earlier one.
RECORDING_RULES = (
    RecordingRule("endpoint:modelplane_router_requests:rate1m",
                  "sum by (endpoint) (rate(modelplane_router_requests_total[1m]))",
                  "requests/s answered by the routers, every status code"),
    RecordingRule("endpoint:modelplane_router_errors:rate1m",
                  'sum by (endpoint) (rate(modelplane_router_requests_total{code=~"5.."}[1m]))',
                  "5xx answers/s: failures of the platform or the model, not of the caller (4xx)"),
    RecordingRule("endpoint:modelplane_router_errors:ratio_rate1m",
                  "endpoint:modelplane_router_errors:rate1m / endpoint:modelplane_router_requests:rate1m",
                  "share of answers that were 5xx"),
    RecordingRule("endpoint:modelplane_router_request_latency_seconds:p99_1m",
                  "histogram_quantile(0.99, sum by (endpoint, le) "
                  "(rate(modelplane_router_request_latency_seconds_bucket[1m])))",
                  "p99 time to the last byte at the routers (what the spec's slo.p99_latency_ms bounds)"),
    RecordingRule("endpoint:modelplane_pyfunc_request_latency_seconds:p99_1m",
                  "histogram_quantile(0.99, sum by (endpoint, le) "
                  "(rate(modelplane_pyfunc_request_latency_seconds_bucket[1m])))",
                  "p99 inside the pyfunc replicas: the router's p99 less this is queueing and the network"),
    RecordingRule("endpoint:modelplane_router_requests_in_flight:sum",
                  "sum by (endpoint) (modelplane_router_requests_in_flight)",
                  "requests in flight, summed over the routers"),
    RecordingRule("endpoint:modelplane_replicas_ready:sum",
                  'sum by (endpoint) (modelplane_replicas{state="ready"})',
                  "ready replicas, every revision"),
    RecordingRule("endpoint:modelplane_utilization:ratio",
                  "endpoint:modelplane_router_requests_in_flight:sum / on (endpoint) "
                  "(sum by (endpoint) (modelplane_autoscaler_target_concurrency * on (endpoint, revision) "
                  'modelplane_replicas{state="ready"}) > 0)',
                  "in flight ÷ (ready replicas of the serving revision × target concurrency): "
                  "1 = at the autoscaler's target; no series while no replica is ready"),
)


@dataclass(frozen=True)
class AlertRule:
    alert: str
    expr: str
    for_s: int  # how long the expression must hold before the alert fires
    severity: str  # warning: look today; critical: users are failing now
    summary: str  # Prometheus template: {{ $labels.endpoint }}, {{ $value }}


#: Read from the recording rules above; a second rule group, evaluated after them.
ALERT_RULES = (
    AlertRule("ModelplaneP99OverSLO",
              "endpoint:modelplane_router_request_latency_seconds:p99_1m > on (endpoint) "
              "modelplane_endpoint_slo_p99_seconds",
              300, "warning", "{{ $labels.endpoint }}: p99 at the routers {{ $value | humanizeDuration }}, over its "
              "SLO for 5 minutes"),
    AlertRule("ModelplaneErrorRatioHigh", "endpoint:modelplane_router_errors:ratio_rate1m > 0.05", 300, "critical",
              "{{ $labels.endpoint }}: {{ $value | humanizePercentage }} of answers are 5xx (the health sensor "
              "rolls a new version back above 5 %)"),
    AlertRule("ModelplaneNoReadyReplica",
              "(sum by (endpoint) (modelplane_revision_desired_replicas) > 0) unless on (endpoint) "
              "(endpoint:modelplane_replicas_ready:sum > 0)",
              120, "critical", "{{ $labels.endpoint }} should have replicas and has none ready: its requests "
              "wait or fail (`modelplane logs {{ $labels.endpoint }}`)"),
    AlertRule("ModelplaneReplicaRestarting", "increase(modelplane_replica_restarts_total[15m]) > 2", 0, "warning",
              "{{ $labels.replica }} of {{ $labels.endpoint }} restarted {{ $value | humanize }} times in 15 "
              "minutes (crash or hang: `modelplane logs {{ $labels.endpoint }}`)"),
)


def find_prometheus_binary() -> Path | None:
    """Debian's ``/usr/bin/prometheus`` (``apt-get install prometheus``), else one on PATH."""
    for candidate in (Path("/usr/bin/prometheus"), shutil.which("prometheus")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def config_document(prometheus_dir: Path) -> dict:
    """``prometheus.yml``: one job per kind of target, each read from its targets file."""
    targets = prometheus_dir / "targets"
    return {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_TIMEOUT_S}s",
                   "evaluation_interval": f"{EVALUATION_INTERVAL_S}s"},
        "rule_files": [str(prometheus_dir / "rules.yml")],
        "scrape_configs": [{"job_name": job, "file_sd_configs": [{"files": [str(targets / name)],
                                                                  "refresh_interval": "10s"}]}
                           for job, name in TARGET_FILES.items()],
    }


def rules_document() -> dict:
    """``rules.yml``: the recording rules, then the alerting rules, one group each."""
    alerts = [{"alert": a.alert, "expr": a.expr, **({"for": f"{a.for_s}s"} if a.for_s else {}),
               "labels": {"severity": a.severity}, "annotations": {"summary": a.summary}} for a in ALERT_RULES]
    return {"groups": [{"name": "modelplane", "rules": [{"record": r.record, "expr": r.expr}
                                                        for r in RECORDING_RULES]},
                       {"name": "modelplane-alerts", "rules": alerts}]}


def write_config(prometheus_dir: Path) -> Path:
    """Write ``prometheus.yml`` and ``rules.yml`` (and make ``targets/`` and ``data/``); returns the config's path."""
    for path in (prometheus_dir, prometheus_dir / "targets", prometheus_dir / "data"):
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in TARGET_FILES.values():  # none yet: no targets, until the targets writer lists them
        if not (prometheus_dir / "targets" / name).exists():
            (prometheus_dir / "targets" / name).write_text("[]\n")
    (prometheus_dir / "rules.yml").write_text(yaml.safe_dump(rules_document(), sort_keys=False, width=200))
    config = prometheus_dir / "prometheus.yml"
    config.write_text(yaml.safe_dump(config_document(prometheus_dir), sort_keys=False))
    return config


def prometheus_argv(binary: Path, prometheus_dir: Path, port: int) -> list[str]:
    return [str(binary), f"--config.file={prometheus_dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={prometheus_dir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]


def main(argv: list[str] | None = None) -> None:
    from controlplane.settings import Settings

    parser = argparse.ArgumentParser(prog="python -m controlplane.prometheus")
    parser.add_argument("--port", type=int, required=True, help="listen on 127.0.0.1:PORT")
    args = parser.parse_args(argv)
    binary = find_prometheus_binary()
    if binary is None:
        sys.exit("prometheus is not installed: run scripts/system-packages.sh as root, or "
                 "apt-get install prometheus (or start modelplane up without --prometheus)")
    directory = Settings.from_env().prometheus_dir
    write_config(directory)
    print(f"prometheus: config written to {directory}, starting {binary}", flush=True)
    command = prometheus_argv(binary, directory, args.port)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
