"""The requests of a routing run: a replica's service model and Poisson arrivals of trace-sized requests.

:class:`ReplicaModel` turns a request's tokens into its service demand ``α·i + β·o + γ`` and
the batching gain ``g(n)``; :func:`make_workload` draws the arrivals one run of
:mod:`autoscale.sim.routing` replays under each balancer, with sizes from an Azure-LLM-trace
CSV (:func:`read_sizes`). The model and the load are described in :mod:`autoscale.sim.routing`.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoscale.sim.demand import DEFAULT_TRACE

TRACE = DEFAULT_TRACE
DRAIN_S = 300.0  # long enough for a 15 s request ten times slowed on an overloaded replica
SIZE_COLUMNS = ("ContextTokens", "GeneratedTokens")

Sizes = tuple[Sequence[int], Sequence[int]]  # (input tokens, output tokens), one entry per request


@dataclass(frozen=True)
class ReplicaModel:
    """How a replica turns tokens into time; α, β, γ are at concurrency 1 on an unslowed replica.

    The defaults are ``benchmarks.balance_quality``'s GPU-like coefficients (uncompressed),
    read as latency alone. The trace's median request (1,020 in, 129 out) then takes 2.1 s
    alone, costs 2118 / g(8) = 357 model units, and 8 of them at once take 1.35× as long.

    >>> model = ReplicaModel()
    >>> model.demand_ms(1020, 129), round(model.gain(8), 3), round(model.gain(10**9), 1)
    (2118.0, 5.926, 20.0)
    >>> round(model.units(1020, 129), 1), model.slowdown(8)
    (357.4, 1.35)
    """

    alpha_ms_per_input_token: float = 0.15
    beta_ms_per_output_token: float = 15.0
    gamma_ms: float = 30.0
    batching_k: float = 0.05
    target_concurrency: int = 8
    max_batch: int | None = None  # None: every request in flight runs; else the rest wait, FIFO

    def __post_init__(self) -> None:
        for name in ("alpha_ms_per_input_token", "beta_ms_per_output_token", "gamma_ms"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a finite number ≥ 0, got {getattr(self, name)}")
        if not 0 <= self.batching_k <= 1:
            raise ValueError(f"batching_k must be in [0, 1] (0: perfect batching, 1: none), got {self.batching_k}")
        if self.target_concurrency < 1 or (self.max_batch is not None and self.max_batch < 1):
            raise ValueError(f"target_concurrency ({self.target_concurrency}) and max_batch ({self.max_batch}) "
                             "must be at least 1")

    def demand_ms(self, input_tokens, output_tokens):
        """α·i + β·o + γ: the time alone on an unslowed replica (scalars or arrays)."""
        return self.alpha_ms_per_input_token * input_tokens + self.beta_ms_per_output_token * output_tokens + \
            self.gamma_ms

    def slowdown(self, running: int) -> float:
        """How many times slower than alone each of ``running`` requests goes: n / g(n) = 1 + (n − 1)·k."""
        return 1.0 + (running - 1) * self.batching_k

    def gain(self, running: int) -> float:
        """g(n) = n / (1 + (n − 1)·k): the replica's throughput with n running, over one alone."""
        return running / self.slowdown(running)

    def units(self, input_tokens, output_tokens):
        """The router's model units: latency at c over c, ``demand / g(c)``."""
        return self.demand_ms(input_tokens, output_tokens) / self.gain(self.target_concurrency)

    def replica_capacity_rps(self, mean_demand_ms: float) -> float:
        """Requests/s one unslowed replica completes running c at once: ``g(c) × 1000 / mean demand``.

        >>> round(ReplicaModel().replica_capacity_rps(3370.0), 3)  # the Azure conversation trace's mean
        1.758
        """
        return self.gain(self.target_concurrency) * 1000.0 / mean_demand_ms


def read_sizes(path: Path | str = TRACE) -> tuple[np.ndarray, np.ndarray]:
    """(input tokens, output tokens) of every row of an Azure-LLM-trace-style CSV; an output of 0 counts as 1."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        found = reader.fieldnames or []
        missing = [column for column in SIZE_COLUMNS if column not in found]
        if missing:
            raise ValueError(f"{path} lacks column(s) {', '.join(missing)} (it has: {', '.join(found)}); "
                             f"request sizes need {', '.join(SIZE_COLUMNS)}")
        rows = [(int(row["ContextTokens"]), max(1, int(row["GeneratedTokens"]))) for row in reader]
    if not rows:
        raise ValueError(f"{path} has no requests")
    inputs, outputs = zip(*rows)
    return np.array(inputs, dtype=np.int64), np.array(outputs, dtype=np.int64)


def _size_arrays(sizes: Sizes) -> tuple[np.ndarray, np.ndarray]:
    inputs, outputs = (np.asarray(column, dtype=np.float64) for column in sizes)
    if inputs.ndim != 1 or inputs.shape != outputs.shape or not len(inputs):
        raise ValueError(f"sizes must be two non-empty sequences of equal length, got shapes {inputs.shape} and "
                         f"{outputs.shape}")
    if (inputs < 0).any() or (outputs < 0).any():
        raise ValueError("token counts must be ≥ 0")
    return inputs, outputs


@dataclass(frozen=True, eq=False)
class Workload:
    """The requests of one run, in arrival order: the same for every balancer compared on it."""

    replicas: int
    model: ReplicaModel
    arrival_ms: np.ndarray  # sorted
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    measure_from_ms: float  # measured: arrivals in [measure_from_ms, measure_until_ms)
    measure_until_ms: float
    horizon_ms: float  # the simulation stops here at the latest
    rate_rps: float
    load_factor: float
    mean_output_tokens: float  # of the size population: the router's estimate without max_tokens


def make_workload(replicas: int, load_factor: float, duration_s: float, seed: int, sizes: Sizes,
                  model: ReplicaModel = ReplicaModel(), warmup_fraction: float = 0.1,
                  drain_s: float = DRAIN_S) -> Workload:
    """Poisson arrivals at ``load_factor × replicas × g(c) / mean demand`` over ``duration_s + drain_s``.

    >>> w = make_workload(4, 0.5, 10.0, seed=1, sizes=([100, 300], [10, 30]), model=ReplicaModel(target_concurrency=1))
    >>> w.rate_rps, w.measure_from_ms, w.measure_until_ms  # demands 195 and 525 ms: 0.5 × 4 × g(1) / 0.36 s
    (5.555555555555555, 1000.0, 10000.0)
    """
    if replicas < 1 or load_factor <= 0 or duration_s <= 0 or drain_s < 0 or not 0 <= warmup_fraction < 1:
        raise ValueError(f"need replicas ≥ 1, load_factor > 0, duration_s > 0, drain_s ≥ 0 and warmup_fraction in "
                         f"[0, 1); got {replicas}, {load_factor}, {duration_s}, {drain_s}, {warmup_fraction}")
    inputs, outputs = _size_arrays(sizes)
    mean_demand_ms = float(np.mean(model.demand_ms(inputs, outputs)))
    rate_rps = load_factor * replicas * model.replica_capacity_rps(mean_demand_ms)
    horizon_ms = (duration_s + drain_s) * 1000.0
    # one stream for the gaps, one for the sizes: the first requests stay the same whatever drain_s is
    gaps_rng, sizes_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    gaps_ms = gaps_rng.exponential(1000.0 / rate_rps, size=int(rate_rps * horizon_ms / 1000.0 * 1.1) + 100)
    while gaps_ms.sum() < horizon_ms:  # rare: Poisson fell short of the 10 % margin
        gaps_ms = np.concatenate([gaps_ms, gaps_rng.exponential(1000.0 / rate_rps, size=len(gaps_ms) // 10 + 100)])
    arrival_ms = np.cumsum(gaps_ms)
    arrival_ms = arrival_ms[arrival_ms < horizon_ms]
    drawn = sizes_rng.integers(0, len(inputs), size=len(arrival_ms))
    return Workload(replicas, model, arrival_ms, inputs[drawn], outputs[drawn], warmup_fraction * duration_s * 1000.0,
                    duration_s * 1000.0, horizon_ms, rate_rps, load_factor, float(np.mean(outputs)))
