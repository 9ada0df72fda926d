"""Autoscaling policies: pure functions of (signals, config, state, now_s) that return a decision.

The policy modules do no I/O and read no clock. The controller (``autoscale.controller``, the
one subpackage that does I/O) gathers the signals (router in-flight samples, replica counts,
latency and utilization), calls these functions with an injected ``now_s`` and applies what
they return; the fleet simulator drives the very same functions with a fake clock. Modules:

- ``horizontal``: how many replicas an endpoint wants, ``desired = ceil(in_flight / target)``,
  fast up, slow down, scale to zero and back.
- ``vertical``: every 30 s, retune the per-replica target from latency against the SLO,
  queue depth and utilization, in bounded steps.
- ``forecast``: a predictive floor from daily seasonality, raised ahead of a known ramp.
- ``units``: the per-replica target in model units (LLM endpoints balanced on cost).
- ``victims``: which replicas to remove when scaling down.
- ``clock``: the ``Clock`` protocol and the ``FakeClock`` tests advance by hand.

See docs/autoscaling.md for the defaults side by side with Kubernetes HPA, Knative and Ray Serve.
"""
