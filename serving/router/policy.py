"""One endpoint's routing policy, as the router applies it: the spec's ``routing``,
``rate_limits`` and ``inference_log`` sections, flattened into one frozen value.

Discovery builds it from the stored spec at every table refresh (:func:`from_spec`), so an
edited spec takes effect on the next refresh, with no restart. Defaults are the spec's
(``controlplane.specs``); a stored spec that does not parse (written by an older version)
gets the defaults rather than taking the endpoint down.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.router.outliers import EjectionConfig


@dataclass(frozen=True)
class RateLimit:
    """A token bucket's rate and burst (``serving.router.ratelimit``); burst = rate × burst_s."""

    rate_per_s: float
    burst: float


@dataclass(frozen=True)
class RoutePolicy:
    balancer: str = "p2c_units"  # serving.router.balancing.BALANCERS
    sticky: str = "none"  # "none" | "session" | "prefix"
    session_header: str = "x-session-id"
    prefix_chars: int = 256
    load_factor: float = 1.25
    endpoint_requests: RateLimit | None = None
    endpoint_units: RateLimit | None = None
    token_requests: RateLimit | None = None
    token_units: RateLimit | None = None
    max_concurrent_requests: int | None = None
    max_queued_requests: int = 64
    max_queue_wait_s: float = 10.0
    ejection: EjectionConfig = field(default_factory=EjectionConfig)
    log_sample_rate: float = 0.0
    log_payloads: bool = False
    log_max_payload_bytes: int = 4096
    log_retention_days: float = 7.0

    @property
    def rate_limited(self) -> bool:
        return any((self.endpoint_requests, self.endpoint_units, self.token_requests, self.token_units))


DEFAULT_POLICY = RoutePolicy()


def from_spec(spec) -> RoutePolicy:
    """The policy of a validated ``EndpointSpec``."""
    routing, limits, log = spec.routing, spec.rate_limits, spec.inference_log

    def bucket(rate: float | None) -> RateLimit | None:
        return None if rate is None else RateLimit(rate, max(rate * limits.burst_s, 1.0))

    ejection = routing.outlier_ejection
    return RoutePolicy(
        balancer=routing.balancer.value, sticky=routing.sticky.key.value,
        session_header=routing.sticky.session_header.lower(), prefix_chars=routing.sticky.prefix_chars,
        load_factor=routing.sticky.load_factor,
        endpoint_requests=bucket(limits.requests_per_s), endpoint_units=bucket(limits.model_units_per_s),
        token_requests=bucket(limits.per_token_requests_per_s), token_units=bucket(limits.per_token_model_units_per_s),
        max_concurrent_requests=routing.max_concurrent_requests, max_queued_requests=routing.max_queued_requests,
        max_queue_wait_s=routing.max_queue_wait_s,
        ejection=EjectionConfig(consecutive_failures=ejection.consecutive_failures, interval_s=ejection.interval_s,
                                base_ejection_s=ejection.base_ejection_s,
                                max_ejected_percent=ejection.max_ejected_percent,
                                max_ejection_s=ejection.max_ejection_s),
        log_sample_rate=log.sample_rate, log_payloads=log.include_payloads,
        log_max_payload_bytes=log.max_payload_bytes, log_retention_days=log.retention_days)
