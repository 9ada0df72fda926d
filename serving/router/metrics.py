"""The router's Prometheus metrics (``/metrics``), one registry per router app.

Names and labels follow docs/metrics.md (one table for the router, the runtimes and the
control plane; ``tests/test_prometheus.py`` holds them to it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("modelplane_router_requests", "Requests by endpoint and status code.",
                                ["endpoint", "code"], registry=registry)
        self.latency = Histogram("modelplane_router_request_latency_seconds", "Time to the last byte.", ["endpoint"],
                                 registry=registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.in_flight = Gauge("modelplane_router_requests_in_flight", "Requests in flight per endpoint.", ["endpoint"],
                               registry=registry)
        self.retries = Counter("modelplane_router_retries", "Requests retried on another replica.", ["endpoint"],
                               registry=registry)
        self.in_flight_units = Gauge("modelplane_router_in_flight_model_units",
                                     "Model units in flight per endpoint (1 per request without a cost model).",
                                     ["endpoint"], registry=registry)
        # Drift: whole answers (not streams) of endpoints with a cost model, observed against predicted.
        self.cost_requests = Counter("modelplane_router_cost_checked_requests",
                                     "Answers whose latency was compared with the cost model.", ["endpoint"],
                                     registry=registry)
        self.cost_observed = Counter("modelplane_router_cost_observed_seconds",
                                     "Observed latency of those answers.", ["endpoint"], registry=registry)
        self.cost_predicted = Counter("modelplane_router_cost_predicted_seconds",
                                      "The cost model's latency for the same answers.", ["endpoint"],
                                      registry=registry)
        # Admission
        self.limited = Counter("modelplane_router_rate_limited", "Requests refused by a rate limit (429) or too "
                               "costly for it (413), by limit.", ["endpoint", "limit"], registry=registry)
        self.queued = Gauge("modelplane_router_queue_depth",
                            "Requests waiting for a slot under max_concurrent_requests.", ["endpoint"],
                            registry=registry)
        # Balancing
        self.sticky = Counter("modelplane_router_sticky_requests", "Requests with a sticky key, by whether their "
                              "key's replica took them.", ["endpoint", "home"], registry=registry)
        self.ejected = Gauge("modelplane_router_ejected_replicas", "Replicas ejected as outliers now.", ["endpoint"],
                             registry=registry)
        self.ejections = Counter("modelplane_router_ejections", "Outlier ejections.", ["endpoint"], registry=registry)
        # Traffic across revisions
        self.revision_requests = Counter("modelplane_router_revision_requests", "Answers by revision, role "
                                         "(serve, canary, shadow) and status code.",
                                         ["endpoint", "revision", "role", "code"], registry=registry)
        self.shadow_dropped = Counter("modelplane_router_shadow_dropped", "Shadow copies not sent because too many "
                                      "were in flight.", ["endpoint"], registry=registry)
        # Inference log
        self.log_dropped = Gauge("modelplane_router_inference_log_dropped", "Records dropped because the buffer was "
                                 "full (since start).", registry=registry)
        self.log_written = Gauge("modelplane_router_inference_log_written", "Records written (since start).",
                                 registry=registry)
        self.log_failed = Gauge("modelplane_router_inference_log_failed", "Records lost to failed writes "
                                "(since start).", registry=registry)
