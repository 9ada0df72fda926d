"""The alerting rules of `modelplane up --prometheus`, evaluated by Prometheus's own rule engine
(`promtool test rules`) over series shaped like the platform's: each alert fires for the
endpoint in trouble, only after its `for`, with its summary rendered, and not for its healthy
neighbour. docs/metrics.md lists the same rules."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from controlplane.prometheus import ALERT_RULES, rules_document
from tests.test_prometheus import _promtool, _rows, _section


def histogram(endpoint: str, per_step: dict[str, int]) -> list[dict]:
    """Latency buckets of one endpoint growing by ``per_step`` answers per scrape (cumulative, as exposed)."""
    return [{"series": f'modelplane_router_request_latency_seconds_bucket{{endpoint="{endpoint}",le="{le}"}}',
             "values": f"0+{count}x60"} for le, count in per_step.items()]


def series(name: str, labels: dict[str, str], values: str) -> dict:
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


SCENARIOS = {
    "ModelplaneP99OverSLO": (
        [*histogram("slow", {"0.1": 0, "1": 10, "+Inf": 10}), *histogram("fast", {"0.1": 10, "1": 10, "+Inf": 10}),
         series("modelplane_endpoint_slo_p99_seconds", {"endpoint": "slow"}, "0.2x60"),
         series("modelplane_endpoint_slo_p99_seconds", {"endpoint": "fast"}, "0.2x60")],
        [("4m", []),  # over its SLO, but not yet for 5 minutes
         ("6m", [({"endpoint": "slow", "severity": "warning"},
                  "slow: p99 at the routers 991ms, over its SLO for 5 minutes")])]),
    "ModelplaneErrorRatioHigh": (
        [series("modelplane_router_requests_total", {"endpoint": "bad", "code": "200"}, "0+90x60"),
         series("modelplane_router_requests_total", {"endpoint": "bad", "code": "503"}, "0+10x60"),
         series("modelplane_router_requests_total", {"endpoint": "good", "code": "200"}, "0+99x60"),
         series("modelplane_router_requests_total", {"endpoint": "good", "code": "503"}, "0+1x60")],
        [("6m", [({"endpoint": "bad", "severity": "critical"},
                  "bad: 10% of answers are 5xx (the health sensor rolls a new version back above 5 %)")])]),
    "ModelplaneNoReadyReplica": (
        [series("modelplane_revision_desired_replicas", {"endpoint": "down", "revision": "down-r1"}, "1x60"),
         series("modelplane_replicas", {"endpoint": "down", "revision": "down-r1", "state": "ready"}, "0x60"),
         series("modelplane_revision_desired_replicas", {"endpoint": "up", "revision": "up-r1"}, "1x60"),
         series("modelplane_replicas", {"endpoint": "up", "revision": "up-r1", "state": "ready"}, "1x60"),
         # scaled to zero on purpose: nothing desired, nothing missing
         series("modelplane_revision_desired_replicas", {"endpoint": "idle", "revision": "idle-r1"}, "0x60"),
         series("modelplane_replicas", {"endpoint": "idle", "revision": "idle-r1", "state": "ready"}, "0x60"),
         # a rollout: the new revision starts while the old one serves
         series("modelplane_revision_desired_replicas", {"endpoint": "up", "revision": "up-r2"}, "1x60"),
         series("modelplane_replicas", {"endpoint": "up", "revision": "up-r2", "state": "ready"}, "0x60")],
        [("1m", []),
         ("3m", [({"endpoint": "down", "severity": "critical"},
                  "down should have replicas and has none ready: its requests wait or fail (`modelplane logs down`)")])]),
    "ModelplaneReplicaRestarting": (
        [series("modelplane_replica_restarts_total", {"endpoint": "gec", "revision": "gec-r1", "replica": "gec-r1-0"},
                "0+1x60"),  # one restart a scrape
         series("modelplane_replica_restarts_total", {"endpoint": "gec", "revision": "gec-r1", "replica": "gec-r1-1"},
                "3x60")],  # restarted long ago, steady since
        [("5m", [({"endpoint": "gec", "revision": "gec-r1", "replica": "gec-r1-0", "severity": "warning"},
                  "gec-r1-0 of gec restarted 20 times in 15 minutes (crash or hang: `modelplane logs gec`)")])]),
}


def test_every_alert_has_a_scenario():
    assert set(SCENARIOS) == {rule.alert for rule in ALERT_RULES}


@pytest.mark.parametrize("alert", sorted(SCENARIOS))
def test_the_alert_fires_for_the_endpoint_in_trouble_only(alert, tmp_path):
    inputs, expectations = SCENARIOS[alert]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules_document(), sort_keys=False, width=200))
    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "15s", "tests": [{
        "interval": "15s", "input_series": inputs,
        "alert_rule_test": [{"eval_time": at, "alertname": alert,
                             "exp_alerts": [{"exp_labels": labels, "exp_annotations": {"summary": summary}}
                                            for labels, summary in expected]}
                            for at, expected in expectations]}]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False, width=200))
    checked = subprocess.run([_promtool(), "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_alerts_on_the_page_are_the_ones_prometheus_loads():
    documented = [(alert.strip("`"), expr.strip("`"), when) for alert, expr, when, *_ in _rows(_section("Alerts"))]
    assert documented == [(a.alert, a.expr, f"{a.for_s} s") for a in ALERT_RULES]
