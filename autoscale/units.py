"""Model-unit mode: the per-replica target when an LLM endpoint is balanced on cost.

One model unit is 1 ms of replica time at the cost model's target concurrency c, and a
request of i input and o output tokens costs ``(α·i + β·o + γ) / c`` units
(``costmodel.fit``, ``serving.router.cost``). The router sums the units of the requests it
has in flight; the horizontal policy then divides that sum by a target in units instead of
in requests. The target is the target concurrency times the cost of the sweep's reference
request: a replica full of reference requests holds exactly ``target`` units, and a replica
full of long prompts reaches it with fewer requests.
"""

from __future__ import annotations

MIN_REQUEST_UNITS = 1e-3  # the router's floor for one request (serving.router.cost.RouteCost.units)


def reference_request_units(alpha_ms_per_input_token: float, beta_ms_per_output_token: float, gamma_ms: float,
                            concurrency: float, input_tokens: float, output_tokens: float) -> float:
    """Model units of the sweep's reference request: ``(α·i + β·o + γ) / c``.

    α = 0.5 ms/token, β = 20 ms/token, γ = 30 ms at c = 4, and a request of 100 input and 10
    output tokens: (50 + 200 + 30) / 4 = 70 units.

        >>> reference_request_units(0.5, 20.0, 30.0, 4, input_tokens=100, output_tokens=10)
        70.0
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    latency_ms = alpha_ms_per_input_token * input_tokens + beta_ms_per_output_token * output_tokens + gamma_ms
    return max(latency_ms / concurrency, MIN_REQUEST_UNITS)


def unit_target(target_concurrency: float, reference_request_units: float) -> float:
    """Per-replica target in model units: ``target_concurrency × reference_request_units``.

    At target concurrency 4 and 70 units per reference request, a replica is full at 280
    units in flight; 2,100 units in flight then want ceil(2100 / 280) = 8 replicas.

        >>> unit_target(4, 70.0)
        280.0
    """
    if target_concurrency <= 0 or reference_request_units <= 0:
        raise ValueError(f"target concurrency ({target_concurrency}) and reference request units "
                         f"({reference_request_units}) must both be > 0")
    return float(target_concurrency) * float(reference_request_units)
