"""Endpoint specs: what a platform engineer writes to put a registered model behind a URL.

A spec is YAML validated by :class:`EndpointSpec`. Unknown fields, wrong types, negative
bounds and ``min_replicas > max_replicas`` are rejected with the field's dotted path in the
message (see :func:`format_validation_error`). ``docs/endpoint-spec.schema.json`` is the
exported JSON schema; ``tests/test_specs.py`` keeps it in step with this file.
"""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

#: A registered model's name as modelplane serves it: never a path, never a control character.
MODEL_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
MODEL_URI = re.compile(rf"^models:/(?P<model>{MODEL_NAME})@(?P<alias>[A-Za-z][A-Za-z0-9_\-]*)$")
ENDPOINT_NAME = r"^[a-z0-9]([a-z0-9\-]{0,61}[a-z0-9])?$"
MAX_SPEC_BYTES = 64 * 1024


MAX_REPLICAS = 256  # per endpoint; a larger fleet is several endpoints or a raised limit in code
MAX_SWEEP_S = 3600.0  # the longest a cost-model sweep may take (points × max_point_s)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Runtime(str, Enum):
    """Which server runs the replicas. ``auto`` picks from the model's MLflow flavor."""

    auto = "auto"
    vllm = "vllm"
    pyfunc = "pyfunc"


class QuantizationScheme(str, Enum):
    auto = "auto"  # FP8 W8A8 on GPU hardware profiles, INT8 W8A8 on CPU profiles
    fp8 = "fp8"
    int8 = "int8"
    none = "none"


class WeightGranularity(str, Enum):
    channel = "channel"
    tensor = "tensor"


class Quantization(_Strict):
    """How an LLM's checkpoint is quantized before it serves (docs/quantization.md); classic models pass through."""

    scheme: QuantizationScheme = Field(QuantizationScheme.auto, description="auto: FP8 W8A8 on GPU hardware profiles, "
                                       "INT8 W8A8 on CPU profiles; fp8, int8, or none (serve the checkpoint as registered).")
    quantize_attention: bool = Field(True, description="Put q/k/v/o projections on the quantized path too, not only the MLP.")
    weight_granularity: WeightGranularity = Field(
        WeightGranularity.channel, description="Weight scales per output channel (default) or one per tensor."
    )
    kv_cache: bool = Field(False, description="Quantize the KV cache as well; trades quality for memory.")


class EvalMetric(str, Enum):
    exact_match = "exact_match"  # share of outputs equal to the reference (whitespace-normalized)
    similarity = "similarity"  # mean character-level similarity to the reference (0-1)


class GateFailure(str, Enum):
    """What a refused candidate leads to when no revision of the endpoint serves yet."""

    serve_baseline = "serve_baseline"  # serve the unquantized checkpoint the gate measured
    block = "block"  # stop the deploy; the endpoint serves nothing until a version passes


class EvalGate(_Strict):
    """The quality bar a quantized candidate must clear before it may serve (docs/quantization.md)."""

    dataset: str | None = Field(None, description="Evaluation set name; none means gec-heldout, the demo set.")
    max_examples: int | None = Field(
        None, ge=10, description="Evaluate on at most this many examples of the set, evenly spaced through it, and as "
        "many of its NLL texts; none means all. Bounds the gate's time on slow hardware: fewer examples widen the "
        "paired tests' intervals, so a smaller drop goes unproven.")
    metric: EvalMetric = Field(EvalMetric.exact_match, description="Task metric compared with baseline and serving revision.")
    max_regression: float = Field(
        0.05, ge=0.0, le=1.0, description="Largest allowed drop of the task metric (absolute, 0-1) against baseline and serving."
    )
    max_nll_increase: float = Field(
        0.02, ge=0.0, description="Largest allowed relative rise of mean per-token NLL on held-out text against baseline."
    )
    min_agreement: float = Field(
        0.5, ge=0.0, le=1.0, description="Smallest share of greedy outputs identical to the baseline's."
    )
    significance: float = Field(
        0.05, gt=0.0, le=1.0, description="A task-metric drop beyond max_regression fails only when a paired one-sided "
        "test gives p below this (McNemar for exact_match); 1.0 fails every drop beyond the bound.")
    on_failure: GateFailure = Field(
        GateFailure.serve_baseline, description="When the candidate is refused and the endpoint serves nothing yet: "
        "serve_baseline serves the unquantized checkpoint, block serves nothing. A later version that is refused "
        "always leaves the serving revision in place.")

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value: str | None) -> str | None:
        from evaluation.datasets import known_eval_sets

        if value is not None and value not in known_eval_sets():
            raise ValueError(f"unknown evaluation set {value!r}; known: {', '.join(known_eval_sets())}")
        return value


class CostModelSweep(_Strict):
    """The benchmark sweep that fits the cost model (docs/cost-model.md): input × output × concurrency."""

    input_tokens: list[Annotated[int, Field(ge=1, le=131072)]] = Field(
        [32, 128, 384], min_length=1, max_length=8, description="LLMs: prompt lengths to sweep, tokens.")
    output_tokens: list[Annotated[int, Field(ge=1, le=16384)]] = Field(
        [16, 48], min_length=1, max_length=8, description="LLMs: output lengths to sweep, tokens.")
    concurrency: list[Annotated[int, Field(ge=1, le=1024)]] = Field(
        [1, 4, 8, 16], min_length=1, max_length=12, description="Requests in flight per replica to sweep.")
    requests_per_point: int = Field(8, ge=1, le=1000, description="Least requests sent at each point.")
    example: dict[str, Any] | None = Field(
        None, description="Classic models: the request body the sweep sends, in MLflow's scoring format (e.g. "
        "{dataframe_split: {columns: [x], data: [[1.0]]}}). None: the model's logged input example; a model logged "
        "without one is deployed unmeasured, at scaling.target_concurrency (else 1), with a warning.")
    max_point_s: float = Field(9.0, gt=0, le=600, description="Time budget of one point, seconds.")

    @model_validator(mode="after")
    def _bounded_duration(self) -> "CostModelSweep":
        points = len(self.input_tokens) * len(self.output_tokens) * len(self.concurrency)
        if points * self.max_point_s > MAX_SWEEP_S:
            raise ValueError(f"the sweep could take up to {points} points × {self.max_point_s:g} s = "
                             f"{points * self.max_point_s:g} s; at most {MAX_SWEEP_S:g} s: sweep fewer values or "
                             "lower max_point_s")
        return self

    @field_validator("example")
    @classmethod
    def _scoring_body(cls, example: dict | None) -> dict | None:
        keys = ("dataframe_split", "dataframe_records", "instances", "inputs")
        if example is not None and sum(key in example for key in keys) != 1:
            raise ValueError(f"example must be an MLflow scoring request with exactly one of {', '.join(keys)}; "
                             f"got keys {sorted(example)}")
        return example

    @field_validator("input_tokens", "output_tokens", "concurrency")
    @classmethod
    def _distinct(cls, values: list[int]) -> list[int]:
        if len(set(values)) != len(values):
            raise ValueError(f"values must be distinct, got {values}")
        return values


class Slo(_Strict):
    """The latency the endpoint is held to: the cost model's target concurrency and the autoscaler aim at it."""

    p99_latency_ms: float = Field(1000.0, gt=0, description="99th percentile request latency target, milliseconds.")
    time_to_first_token_ms: float | None = Field(None, gt=0, description="LLMs: p99 time to first token, milliseconds.")


class ScalingSignal(str, Enum):
    """What the horizontal autoscaler counts (``autoscale.controller.loop``)."""

    auto = "auto"  # model units for an LLM with a cost profile, else requests
    requests = "requests"
    model_units = "model_units"


class Scaling(_Strict):
    """How many replicas, and what the autoscaler scales on (docs/autoscaling.md)."""

    min_replicas: int = Field(1, ge=0, le=MAX_REPLICAS, description="Provisioned replicas; 0 allows scale to zero.")
    max_replicas: int = Field(4, ge=1, le=MAX_REPLICAS, description="Upper bound on replicas.")
    target_concurrency: float | None = Field(
        None, gt=0, le=4096, description="In-flight requests per replica. None: start from the benchmarked cost model "
        "and let the vertical autoscaler retune it within the sweep's levels; a number pins it."
    )
    scale_to_zero_grace_s: float = Field(300.0, ge=1, le=86400,
                                         description="With min_replicas 0: idle seconds before the last replica goes.")
    signal: ScalingSignal = Field(ScalingSignal.auto, description="What the autoscaler counts in flight: requests, "
                                  "or model units priced by the cost model (auto: model units for LLMs with a profile).")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "Scaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})"
            )
        return self


class RateLimits(_Strict):
    """Token buckets the router checks before a request is sent (docs/router.md "Admission").

    Each limit refills at its rate and holds at most ``burst_s`` seconds of it (at least one
    request or unit); a request beyond it is answered 429 with a Retry-After, in seconds, after
    which it would be admitted."""

    requests_per_s: float | None = Field(None, gt=0, description="Per-endpoint request rate limit, requests per second.")
    model_units_per_s: float | None = Field(None, gt=0, description="Per-endpoint cost rate limit, model units per "
                                            "second (one unit is one millisecond of replica time, docs/cost-model.md).")
    per_token_requests_per_s: float | None = Field(None, gt=0, description="Per bearer token, requests per second.")
    per_token_model_units_per_s: float | None = Field(None, gt=0, description="Per bearer token, model units per "
                                                      "second.")
    burst_s: float = Field(1.0, gt=0, le=3600, description="Each bucket holds this many seconds of its rate: the "
                           "largest burst admitted at once, seconds.")


class Balancer(str, Enum):
    """How the router picks a replica (``serving.router.balancing``)."""

    p2c_units = "p2c_units"  # power of two choices on in-flight model units (requests without a cost model)
    p2c_requests = "p2c_requests"
    least_loaded = "least_loaded"  # fewest model units in flight, over every replica
    round_robin = "round_robin"
    random = "random"


class StickyKey(str, Enum):
    none = "none"
    session = "session"  # the value of sticky.session_header
    prefix = "prefix"  # the first sticky.prefix_chars characters of the prompt (or chat messages)


class Sticky(_Strict):
    """Keep a session or a prompt prefix on one replica (its caches stay warm), within a bound on its load."""

    key: StickyKey = Field(StickyKey.none, description="What requests stick by: none, session or prefix.")
    session_header: str = Field("X-Session-Id", pattern=r"^[A-Za-z0-9\-]{1,64}$",
                                description="Header naming the session, with key: session.")
    prefix_chars: int = Field(256, ge=1, le=65536, description="With key: prefix, characters of the prompt (chat: "
                              "role and content of each message) that make the key.")
    load_factor: float = Field(1.25, ge=1.0, le=10.0, description="A key's replica takes it only while its in-flight "
                               "model units stay within load_factor × the mean; otherwise P2C among those within.")


class OutlierEjection(_Strict):
    """Envoy's outlier detection, with its defaults (docs/router.md "Outlier ejection")."""

    consecutive_failures: int = Field(5, ge=1, le=1000, description="5xx answers or failed connects in a row that "
                                      "eject a replica.")
    interval_s: float = Field(10.0, gt=0, le=3600, description="Each interval a replica spends back in rotation "
                              "takes one off its ejection count, seconds.")
    base_ejection_s: float = Field(30.0, gt=0, le=86400, description="An ejection lasts this × the number of times "
                                   "the replica was ejected, seconds.")
    max_ejected_percent: float = Field(10.0, ge=0, le=100, description="Most of an endpoint's replicas ejected at "
                                       "once, percent (at least one of two or more; never all).")
    max_ejection_s: float = Field(300.0, gt=0, le=86400, description="No ejection lasts longer, seconds.")


class Routing(_Strict):
    """How the router picks a replica and bounds what runs at once (docs/router.md)."""

    balancer: Balancer = Field(Balancer.p2c_units, description="How a replica is picked.")
    sticky: Sticky = Sticky()
    max_concurrent_requests: int | None = Field(None, ge=1, le=1_000_000, description="Requests this endpoint runs at "
                                                "once across its replicas, per router; more wait in a queue. None: "
                                                "no limit.")
    max_queued_requests: int = Field(64, ge=0, le=100_000, description="With max_concurrent_requests: requests "
                                     "waiting per router; more are answered 429.")
    max_queue_wait_s: float = Field(10.0, gt=0, le=600, description="Longest wait in that queue before a 503, seconds.")
    outlier_ejection: OutlierEjection = OutlierEjection()


class InferenceLog(_Strict):
    """Sampled records of what the router served, in the control-plane database (``modelplane requests``)."""

    sample_rate: float = Field(0.0, ge=0, le=1, description="Share of requests recorded (0: off, 1: every one).")
    include_payloads: bool = Field(False, description="Record request and response bodies too, capped at "
                                   "max_payload_bytes each.")
    max_payload_bytes: int = Field(4096, ge=1, le=1 << 20, description="Longest body recorded, bytes (the rest is "
                                   "cut and marked).")
    retention_days: float = Field(7.0, gt=0, le=3650, description="Records older than this are deleted (by the "
                                  "routers, every 10 minutes), days.")


class Rollout(_Strict):
    """How a new version replaces the serving one (``assets.canary``)."""

    canary_percent: float = Field(0.0, ge=0, lt=100, description="Share of requests the new revision takes in a "
                                  "canary phase before it takes all, percent; 0: no canary phase, switch at once.")
    canary_duration_s: float = Field(300.0, gt=0, le=86400, description="Length of the canary phase, seconds.")
    canary_max_error_increase: float = Field(0.01, ge=0, le=1, description="The canary fails when its share of "
                                             "failed answers (server errors, and 400s where the model raised on input "
                                             "that passed its signature) exceeds the serving revision's by more than "
                                             "this (absolute, 0.01 = one point).")
    canary_max_p99_ratio: float = Field(1.2, ge=1, le=100, description="The canary fails when its p99 is over the "
                                        "SLO's and over this × the serving revision's p99.")


class ReplicaOptions(_Strict):
    """How each replica's server runs (``serving.runtime.base.RuntimeConfig``)."""

    api_server_count: int = Field(1, ge=1, le=16, description="vLLM: API server (front-end) processes per replica.")
    workers: int = Field(1, ge=1, le=64, description="pyfunc: scoring worker processes per replica.")
    max_batch_size: int = Field(64, ge=1, le=4096, description="pyfunc: most requests predicted together.")
    max_batch_wait_ms: float = Field(2.0, ge=0, le=1000, description="pyfunc: longest wait for a batch to fill, ms.")
    cpu_cores: float | None = Field(None, gt=0, le=1024, description="CPU cores per replica: its threads are sized to "
                                    "them, and on Kubernetes they are the pod's CPU request and limit. None: the local "
                                    "machine's (or its cgroup's) cores; on Kubernetes, the install's default.")
    memory_gib: float | None = Field(None, gt=0, le=4096, description="Memory per replica, GiB: what capacity checks "
                                     "reserve for it, what a vLLM replica sizes its KV cache within, and on Kubernetes "
                                     "the pod's memory request and limit. None: "
                                     "the least the runtime needs (cluster.capacity); on Kubernetes, the install's default.")
    gpus: int = Field(0, ge=0, le=16, description="GPUs per replica (Kubernetes: nvidia.com/gpu). The local backend "
                      "refuses a revision that asks for GPUs on a machine without CUDA.")


class EndpointSpec(_Strict):
    """One serving endpoint: a registered model's alias, and how to serve it."""

    name: Annotated[str, Field(pattern=ENDPOINT_NAME, description="URL-safe endpoint name (DNS label).")]
    model: Annotated[str, Field(description="Registered model and alias, e.g. models:/gec@champion.")]
    runtime: Runtime = Runtime.auto
    quantization: Quantization = Quantization()
    eval_gate: EvalGate = EvalGate()
    slo: Slo = Slo()
    cost_model: CostModelSweep = CostModelSweep()
    scaling: Scaling = Scaling()
    rate_limits: RateLimits = RateLimits()
    routing: Routing = Routing()
    inference_log: InferenceLog = InferenceLog()
    rollout: Rollout = Rollout()
    replica: ReplicaOptions = ReplicaOptions()

    @field_validator("model")
    @classmethod
    def _model_uri_has_alias(cls, value: str) -> str:
        if not MODEL_URI.match(value):
            raise ValueError(f"must look like models:/<registered model>@<alias>, got {value!r}")
        return value

    @property
    def registered_model(self) -> str:
        return MODEL_URI.match(self.model)["model"]

    @property
    def alias(self) -> str:
        return MODEL_URI.match(self.model)["alias"]


class SpecError(ValueError):
    """A spec that cannot be used, with a message that names the offending field."""


def format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(spec)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(f"{where}: {message}")
    return "\n".join(lines)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice (the last would silently win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise SpecError(f"duplicate key {key!r} on line {key_node.start_mark.line + 1}: give each field once")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_spec(text: str) -> EndpointSpec:
    """Parse and validate YAML (or JSON) text into a spec, or raise :class:`SpecError`."""
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise SpecError(f"spec is larger than {MAX_SPEC_BYTES} bytes")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise SpecError("the document is nested too deeply to be an endpoint spec") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError("a spec must be a mapping with at least 'name' and 'model'")
    try:
        return EndpointSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc)) from None


def load_spec(path: Path) -> EndpointSpec:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror}") from None
    return parse_spec(text)


def json_schema() -> dict:
    return EndpointSpec.model_json_schema()
