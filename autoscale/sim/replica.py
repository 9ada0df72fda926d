"""One simulated replica: throughput and latency at a concurrency, from a cost model; cold starts.

The cost model (``costmodel.fit.CostModel``) gives, per swept concurrency c, the latency of a
request of i input and o output tokens: ``α_c·i + β_c·o + γ_c`` ms. Between two swept levels
the coefficients are interpolated linearly in c; below the first level the first level's are
used, and a replica never runs more than ``max_batch`` (the largest swept level) at once:
more wait in its engine's queue. With the request sizes of the demand (their means ī, ō):

    latency_ms(n)     = α(n)·ī + β(n)·ō + γ(n)
    throughput_rps(n) = 1000 · n / latency_ms(n)          (Little's law, per replica)

The share of requests within an SLO at concurrency n, after a wait w, is read from a table
of every size's latency at a grid of concurrencies (``share_within``): the whole size
distribution, not its mean, sets the tail.

``h100_small`` is the preset for the seeds' figure of about 1,200 req/s per replica for a
small model on one H100: at its target concurrency 64 a request of the Azure trace's mean size
takes 53 ms, and its p99 (112 ms) holds the preset's SLO of 150 ms where 128 (167 ms) does
not. Its levels' latencies grow as ``0.5 + 0.5·c/64``: batching raises throughput towards
twice the rate at 64 (2,130 req/s at 512 in flight), at a latency no SLO near the target
allows, which is the headroom a burst runs into before it queues.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from costmodel.fit import Coefficients, CostModel

H100_SMALL_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
H100_SMALL_AT_64 = (0.01, 0.15, 10.0)  # α ms/input token, β ms/output token, γ ms
H100_SMALL_SLO_P99_MS = 150.0
_GRID_POINTS = 192
_BUDGET_POINTS = 1024


def _h100_multiplier(c: int) -> float:
    return 0.5 + 0.5 * c / 64


def h100_small(input_tokens: np.ndarray, output_tokens: np.ndarray,
               slo_p99_ms: float = H100_SMALL_SLO_P99_MS) -> CostModel:
    """The preset cost model; its target is the highest level whose p99 over these sizes holds the SLO."""
    alpha, beta, gamma = H100_SMALL_AT_64
    levels = {c: Coefficients(alpha * _h100_multiplier(c), beta * _h100_multiplier(c), gamma * _h100_multiplier(c), c)
              for c in H100_SMALL_LEVELS}
    holding = [c for c, k in levels.items()
               if np.percentile(k.alpha_ms_per_input_token * input_tokens + k.beta_ms_per_output_token * output_tokens
                                + k.gamma_ms, 99) <= slo_p99_ms]
    target = max(holding) if holding else H100_SMALL_LEVELS[0]
    return CostModel(levels=levels, target_concurrency=target, slo_met=bool(holding),
                     slo_message=(f"preset h100_small: concurrency {target} is the highest level whose p99 over the "
                                  f"demand's sizes holds {slo_p99_ms:g} ms" if holding else
                                  f"preset h100_small: no level holds {slo_p99_ms:g} ms at p99 over the demand's "
                                  f"sizes; priced at concurrency {target}"),
                     r2=math.nan, heldout_median_abs_pct_error=math.nan, n_samples=0, kind="llm",
                     slo_p99_ms=slo_p99_ms)


@dataclass(frozen=True)
class ColdStart:
    """Time from order to ready, lognormal with the given median and p90 (seconds).

        >>> ColdStart("plain", 120.0, 240.0).mean_s > 120.0
        True
    """

    kind: str
    median_s: float
    p90_s: float

    def __post_init__(self) -> None:
        if not 0 < self.median_s <= self.p90_s:
            raise ValueError(f"cold start {self.kind!r}: need 0 < median_s ≤ p90_s, got {self.median_s}, {self.p90_s}")

    @property
    def sigma(self) -> float:
        return math.log(self.p90_s / self.median_s) / 1.2815515655446004  # z of the 90th percentile

    @property
    def mean_s(self) -> float:
        return self.median_s * math.exp(self.sigma ** 2 / 2)

    def quantile_s(self, q: float) -> float:
        from statistics import NormalDist

        return self.median_s * math.exp(self.sigma * NormalDist().inv_cdf(q))

    def draw_s(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.median_s * np.exp(self.sigma * rng.standard_normal(n))


# Assumed until measured (issue 14 measures image pull, lazy fetch and warm pool): a small model on a GPU node.
COLD_STARTS = {
    "plain": ColdStart("plain", 120.0, 240.0),  # full image pull + engine start-up
    "lazy_image": ColdStart("lazy_image", 25.0, 45.0),  # index only, sectors on first read, then engine start-up
    "warm_pool": ColdStart("warm_pool", 6.0, 10.0),  # a pre-started runtime process loads the weights
}


class ReplicaModel:
    """Latency and throughput of one replica at concurrency n, for a demand's request sizes."""

    def __init__(self, cost: CostModel, input_tokens: np.ndarray, output_tokens: np.ndarray,
                 slo_ms: float | None = None, max_batch: int | None = None) -> None:
        if len(input_tokens) == 0 or len(input_tokens) != len(output_tokens):
            raise ValueError("need the same non-zero number of input and output token counts")
        self.cost = cost
        self.slo_ms = float(slo_ms if slo_ms is not None else cost.slo_p99_ms)
        levels = sorted(cost.levels)
        self.max_batch = int(max_batch if max_batch is not None else levels[-1])
        self.target_concurrency = float(cost.target_concurrency)
        self._levels = np.array(levels, dtype=float)
        self._coefficients = np.array([[cost.levels[c].alpha_ms_per_input_token, cost.levels[c].beta_ms_per_output_token,
                                        cost.levels[c].gamma_ms] for c in levels])
        self.grid = np.unique(np.concatenate([np.geomspace(1, self.max_batch, _GRID_POINTS),
                                              self._levels[self._levels <= self.max_batch], [self.max_batch]]))
        coefficients = self._coefficients_at(self.grid)
        mean_i, mean_o = float(np.mean(input_tokens)), float(np.mean(output_tokens))
        self.latency_grid_ms = coefficients @ np.array([mean_i, mean_o, 1.0])
        throughput = 1000.0 * self.grid / self.latency_grid_ms
        self.throughput_grid_rps = np.maximum.accumulate(throughput)  # beyond the best batch, more only waits
        self.max_throughput_rps = float(self.throughput_grid_rps[-1])
        self.knee = float(self.grid[int(np.argmax(throughput >= self.max_throughput_rps * (1 - 1e-9)))])
        # Every size's latency at every grid concurrency, sorted: the share within a budget by binary search.
        latencies = np.sort(coefficients @ np.vstack([input_tokens, output_tokens, np.ones(len(input_tokens))]), axis=1)
        self._budgets_ms = np.linspace(0.0, self.slo_ms, _BUDGET_POINTS)
        self._share = np.stack([np.searchsorted(row, self._budgets_ms, side="right") / row.size for row in latencies])
        self._p99_grid_ms = np.percentile(latencies, 99, axis=1)

    def _coefficients_at(self, n: np.ndarray) -> np.ndarray:
        clipped = np.clip(n, self._levels[0], self._levels[-1])
        return np.column_stack([np.interp(clipped, self._levels, self._coefficients[:, k]) for k in range(3)])

    def latency_ms(self, n: float) -> float:
        """Mean latency at n in flight per replica (n capped at ``max_batch``)."""
        return float(np.interp(min(n, self.max_batch), self.grid, self.latency_grid_ms))

    def p99_ms(self, n: float) -> float:
        """p99 over the request sizes at n in flight per replica, with no wait."""
        return float(np.interp(min(n, self.max_batch), self.grid, self._p99_grid_ms))

    def throughput_rps(self, n: float) -> float:
        return float(np.interp(min(n, self.max_batch), self.grid, self.throughput_grid_rps))

    def concurrency_for(self, rps_per_replica: float) -> float:
        """The concurrency at which one replica serves ``rps_per_replica``; at or beyond its capacity, the
        knee (the lowest concurrency reaching it): a deeper batch would add latency, not throughput, so
        the excess is counted as waiting, with its wait, rather than twice."""
        if rps_per_replica >= self.max_throughput_rps:
            return self.knee
        # Below one request in flight (a replica idle part of the time), concurrency falls linearly to 0.
        return float(np.interp(rps_per_replica, np.concatenate([[0.0], self.throughput_grid_rps]),
                               np.concatenate([[0.0], self.grid])))

    def share_within(self, n: np.ndarray, budget_ms: np.ndarray) -> np.ndarray:
        """Share of requests whose latency at concurrency ``n`` is ≤ ``budget_ms`` (vectorized, bilinear)."""
        n = np.clip(np.asarray(n, dtype=float), self.grid[0], self.max_batch)
        budget = np.asarray(budget_ms, dtype=float)
        row = np.clip(np.searchsorted(self.grid, n, side="right") - 1, 0, len(self.grid) - 2)
        weight = (n - self.grid[row]) / (self.grid[row + 1] - self.grid[row])
        position = np.clip(budget, 0.0, self.slo_ms) / self.slo_ms * (_BUDGET_POINTS - 1)
        column = np.clip(np.floor(position).astype(np.int64), 0, _BUDGET_POINTS - 2)
        frac = position - column
        share = np.zeros(np.broadcast(n, budget).shape)
        for r, w in ((row, 1 - weight), (row + 1, weight)):
            share = share + w * (self._share[r, column] * (1 - frac) + self._share[r, column + 1] * frac)
        return np.where(budget < 0, 0.0, share)

    def concurrency_at_slo_p99(self) -> float:
        """The highest concurrency at which the p99 over the request sizes holds the SLO (the first
        grid point when none does)."""
        holding = np.nonzero(self._p99_grid_ms <= self.slo_ms)[0]
        return float(self.grid[holding[-1]]) if holding.size else float(self.grid[0])

    def capacity_at_slo(self, attainment: float) -> tuple[float, float]:
        """(concurrency, req/s per replica) at the highest grid concurrency whose share within the SLO
        (no wait) is ≥ ``attainment``: what one replica can carry and still meet it."""
        shares = self._share[:, -1]
        holding = np.nonzero(shares >= attainment)[0]
        if holding.size == 0:
            return float(self.grid[0]), float(self.throughput_grid_rps[0])
        j = int(holding[-1])
        return float(self.grid[j]), float(self.throughput_grid_rps[j])
