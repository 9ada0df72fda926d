"""The tags the deploy pipeline writes on each MLflow model version (pure: names and values, no I/O).

A data scientist reads a version's registry page; these tags answer there "is my version
live, and if not, why", with what the gate decided and what a request costs. Each step writes
its own tags through ``ModelRegistry.set_version_tags`` (a value of ``None`` deletes a tag that
no longer holds, e.g. the reason a version did not serve once it serves). docs/pipeline-metadata.md
lists them; ``tests/test_pipeline_metadata.py`` checks that list against :data:`ALL_TAGS`.

>>> serving_tags([], "the eval gate refused int8-w8a8-channel")["modelplane.serving.state"]
'not serving'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

PREFIX = "modelplane."
QUANTIZATION_SCHEME = "modelplane.quantization.scheme"
QUANTIZATION_HARDWARE = "modelplane.quantization.hardware_profile"
QUANTIZATION_DETAIL = "modelplane.quantization.detail"
GATE_RESULT = "modelplane.gate.result"
GATE_INTERVAL = "modelplane.gate.interval"
GATE_DECISION = "modelplane.gate.decision"
GATE_REASONS = "modelplane.gate.reasons"
COST_ALPHA = "modelplane.cost.alpha_ms_per_input_token"
COST_BETA = "modelplane.cost.beta_ms_per_output_token"
COST_GAMMA = "modelplane.cost.gamma_ms"
COST_TARGET = "modelplane.cost.target_concurrency"
COST_HARDWARE = "modelplane.cost.hardware_profile"
COST_SLO_MET = "modelplane.cost.slo_met"
SERVING_STATE = "modelplane.serving.state"
SERVING_ENDPOINT = "modelplane.serving.endpoint"
SERVING_URL = "modelplane.serving.url"
SERVING_REVISION = "modelplane.serving.revision"
SERVING_CHECKPOINT = "modelplane.serving.checkpoint"
SERVING_SINCE = "modelplane.serving.since"
SERVING_REASON = "modelplane.serving.reason"

ALL_TAGS = (QUANTIZATION_SCHEME, QUANTIZATION_HARDWARE, QUANTIZATION_DETAIL, GATE_RESULT, GATE_INTERVAL,
            GATE_DECISION, GATE_REASONS, COST_ALPHA, COST_BETA, COST_GAMMA, COST_TARGET, COST_HARDWARE,
            COST_SLO_MET, SERVING_STATE, SERVING_ENDPOINT, SERVING_URL, SERVING_REVISION, SERVING_CHECKPOINT,
            SERVING_SINCE, SERVING_REASON)
SERVING, NOT_SERVING = "serving", "not serving"
#: passed; refused (see modelplane.gate.reasons); not gated (nothing was quantized); could not judge
#: (the baseline or the serving revision could not be evaluated: the run stopped).
GATE_RESULTS = ("passed", "refused", "not gated", "could not judge")
MAX_VALUE_CHARS = 2000  # MLflow allows 100,000; a registry page shows a sentence, not a log

Tags = dict[str, str | None]


def _short(text: str) -> str:
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


def quantization_tags(scheme: str | None, hardware_profile: str, detail: str | None = None) -> Tags:
    """What ``quantized_checkpoint`` made: the scheme (``none`` when it passed the model through) and why.

    >>> quantization_tags(None, "cpu/x86 AMX", "sklearn model: served as registered")[QUANTIZATION_SCHEME]
    'none'
    """
    return {QUANTIZATION_SCHEME: scheme or "none", QUANTIZATION_HARDWARE: hardware_profile,
            QUANTIZATION_DETAIL: _short(detail) if detail else None}


def interval_text(paired: Mapping | None, metric_check: str) -> str | None:
    """The task check's paired comparison in one line (``PairedComparison.to_json()``).

    >>> interval_text({"n": 80, "drop": 0.0125, "interval": [-0.05, 0.075], "confidence": 0.95,
    ...                "p_value": 0.41}, "exact_match vs baseline")
    'exact_match vs baseline: drop 0.013, 95% interval -0.050 to 0.075, p = 0.410, 80 examples'
    """
    if not paired:
        return None
    low, high = paired["interval"]
    return (f"{metric_check}: drop {paired['drop']:.3f}, {paired['confidence']:.0%} interval {low:.3f} to "
            f"{high:.3f}, p = {paired['p_value']:.3f}, {paired['n']} examples")


def gate_tags(result: str, decision: str, interval: str | None = None, reasons: Sequence[str] = ()) -> Tags:
    """What ``eval_gate`` decided: ``result`` is one of :data:`GATE_RESULTS`; ``None`` deletes what an
    earlier run of the gate wrote and no longer holds."""
    if result not in GATE_RESULTS:
        raise ValueError(f"gate result must be one of {', '.join(GATE_RESULTS)}, got {result!r}")
    return {GATE_RESULT: result, GATE_DECISION: _short(decision), GATE_INTERVAL: interval,
            GATE_REASONS: _short("; ".join(reasons)) if reasons else None}


def cost_tags(cost_model: Mapping, hardware_profile: str) -> Tags:
    """The coefficients at the target concurrency (``CostModel.to_json()``) and where they were measured.

    >>> tags = cost_tags({"target_concurrency": 4, "slo_met": True, "levels": [
    ...     {"concurrency": 4, "alpha_ms_per_input_token": 0.5, "beta_ms_per_output_token": 20.0, "gamma_ms": 30.0}]},
    ...     "cpu/x86")
    >>> tags[COST_ALPHA], tags[COST_TARGET], tags[COST_SLO_MET]
    ('0.5', '4', 'true')
    """
    target = cost_model["target_concurrency"]
    [level] = [lv for lv in cost_model["levels"] if lv["concurrency"] == target]
    return {COST_ALPHA: f"{level['alpha_ms_per_input_token']:.6g}", COST_BETA: f"{level['beta_ms_per_output_token']:.6g}",
            COST_GAMMA: f"{level['gamma_ms']:.6g}", COST_TARGET: str(target), COST_HARDWARE: hardware_profile,
            COST_SLO_MET: "true" if cost_model["slo_met"] else "false"}


def serving_tags(serving: Sequence[Mapping], reason_if_none: str) -> Tags:
    """Where the version serves now, from the revisions that hold endpoints' traffic, or why it does not.

    ``serving``: one dict per endpoint whose traffic goes to a revision of this version, with
    ``endpoint``, ``revision``, ``url``, ``checkpoint`` and ``since`` (ISO 8601, UTC). Several
    endpoints are listed comma-separated, ``since`` is the earliest.

    >>> tags = serving_tags([{"endpoint": "gec", "revision": "gec-v3-ab", "url": "http://r/serving-endpoints/gec/invocations",
    ...                       "checkpoint": "int8-w8a8-channel", "since": "2026-12-01T22:00:00+00:00"}], "unused")
    >>> tags[SERVING_STATE], tags[SERVING_ENDPOINT], tags[SERVING_SINCE], tags[SERVING_REASON]
    ('serving', 'gec', '2026-12-01T22:00:00+00:00', None)
    """
    if not serving:
        return {SERVING_STATE: NOT_SERVING, SERVING_REASON: _short(reason_if_none), SERVING_ENDPOINT: None,
                SERVING_URL: None, SERVING_REVISION: None, SERVING_CHECKPOINT: None, SERVING_SINCE: None}
    ordered = sorted(serving, key=lambda s: s["endpoint"])
    since = [s["since"] for s in ordered if s.get("since")]
    return {SERVING_STATE: SERVING, SERVING_REASON: None,
            SERVING_ENDPOINT: ", ".join(s["endpoint"] for s in ordered),
            SERVING_URL: ", ".join(s["url"] for s in ordered),
            SERVING_REVISION: ", ".join(s["revision"] for s in ordered),
            SERVING_CHECKPOINT: ", ".join(sorted({s["checkpoint"] for s in ordered if s.get("checkpoint")})) or None,
            SERVING_SINCE: min(since) if since else None}
