"""Fit a served checkpoint's cost model from its sweep: pure functions, no I/O.

Per concurrency level c, a request of i input tokens and o output tokens takes

    latency_ms(i, o | c) = α_c·i + β_c·o + γ_c

fitted with non-negative least squares. At a fixed batch size this is how LLM decoding
behaves: α ≈ prefill time per prompt token, β ≈ one decode step, γ ≈ fixed overhead. A
classic (non-LLM) model has no token axes: α = β = 0 and γ_c is the mean latency at c.

One model unit is 1 ms of replica time. A request in flight at concurrency c holds 1/c of
the replica for its latency, so at the target level c

    model_units(i, o) = (α_c·i + β_c·o + γ_c) / c

and a replica serves 1000 model units per second. With α = 0.5, β = 20, γ = 30 at c = 4,
a request of 100 input and 10 output tokens costs (50 + 200 + 30) / 4 = 70 model units.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from costmodel.sweep import RequestSample, SweepError, SweepGrid, SweepPoint, number_or_nan, number_or_none
from costmodel.target import target_concurrency

KINDS = ("llm", "classic")
MODEL_UNITS_PER_REPLICA_S = 1000.0  # one model unit is 1 ms of replica time
HELDOUT_EVERY = 3  # every 3rd (input, output) shape of a level is held out: 2 of the default grid's 6
MIN_LLM_SAMPLES_PER_LEVEL = 3  # α, β, γ: three unknowns


@dataclass(frozen=True)
class Coefficients:
    """The latency model of one concurrency level.

        >>> level = Coefficients(0.5, 20.0, 30.0, concurrency=4)
        >>> level.latency_ms(100, 10), level.model_units(100, 10)
        (280.0, 70.0)
    """

    alpha_ms_per_input_token: float
    beta_ms_per_output_token: float
    gamma_ms: float
    concurrency: int

    def __post_init__(self) -> None:
        for name in ("alpha_ms_per_input_token", "beta_ms_per_output_token", "gamma_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number ≥ 0, got {value}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")

    def latency_ms(self, input_tokens: int, output_tokens: int) -> float:
        """α·i + β·o + γ: the predicted latency of one request at this level."""
        return (self.alpha_ms_per_input_token * input_tokens + self.beta_ms_per_output_token * output_tokens
                + self.gamma_ms)

    def model_units(self, input_tokens: int, output_tokens: int) -> float:
        """The replica time one request holds, in ms: its latency shared by the c in flight."""
        return self.latency_ms(input_tokens, output_tokens) / self.concurrency

    def to_json(self) -> dict:
        return {"alpha_ms_per_input_token": self.alpha_ms_per_input_token,
                "beta_ms_per_output_token": self.beta_ms_per_output_token,
                "gamma_ms": self.gamma_ms, "concurrency": self.concurrency}

    @classmethod
    def from_json(cls, data: dict) -> Coefficients:
        return cls(float(data["alpha_ms_per_input_token"]), float(data["beta_ms_per_output_token"]),
                   float(data["gamma_ms"]), int(data["concurrency"]))


@dataclass(frozen=True)
class _LevelRows:
    """The successful measurements of one level; a point's row stands for its n_ok requests."""

    concurrency: int
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    latency_ms: np.ndarray
    weight: np.ndarray
    n_failed: int


def _level_rows(samples_or_points: Iterable[RequestSample | SweepPoint], concurrency: int) -> _LevelRows:
    columns: list[tuple[int, int, float, int]] = []
    n_failed = 0
    for row in samples_or_points:
        if row.concurrency != concurrency:
            continue
        if isinstance(row, RequestSample):
            if row.ok:
                columns.append((row.input_tokens, row.output_tokens, row.latency_ms, 1))
            else:
                n_failed += 1
        elif isinstance(row, SweepPoint):
            n_failed += row.n_failed
            if row.n_ok:
                columns.append((row.input_tokens, row.output_tokens, row.mean_latency_ms, row.n_ok))
        else:
            raise TypeError(f"expected RequestSample or SweepPoint, got {type(row).__name__}")
    i, o, latency, weight = (np.array(c, dtype=float) for c in zip(*columns)) if columns else [np.zeros(0)] * 4
    return _LevelRows(concurrency, i, o, latency, weight, n_failed)


def _check_fittable(level: _LevelRows, kind: str) -> None:
    """Raise SweepError, saying what to change, when the rows cannot determine the level's model."""
    c = level.concurrency
    broken = ~(np.isfinite(level.latency_ms) & (level.latency_ms >= 0))
    if broken.any():
        examples = ", ".join(f"{v:g}" for v in level.latency_ms[broken][:3])
        raise SweepError(f"{int(broken.sum())} successful request(s) at concurrency {c} have a latency that is "
                         f"not a finite number of ms ≥ 0 ({examples}); the measurement is broken — fix the load "
                         "generator and rerun the sweep")
    n_ok = int(level.weight.sum())
    if n_ok == 0:
        if level.n_failed:
            raise SweepError(f"every request at concurrency {c} failed ({level.n_failed}); see the replica log, "
                             "or leave that level out of the sweep")
        raise SweepError(f"the sweep has no requests at concurrency {c}")
    if kind == "classic":
        return
    if n_ok < MIN_LLM_SAMPLES_PER_LEVEL:
        raise SweepError(f"concurrency {c} has {n_ok} successful request(s) ({level.n_failed} failed); fitting "
                         f"α, β, γ needs at least {MIN_LLM_SAMPLES_PER_LEVEL} — see the replica log, or send "
                         "more requests per point")
    problem = _shapes_problem(set(zip(level.input_tokens.tolist(), level.output_tokens.tolist())), f"at concurrency {c}")
    if problem:
        raise SweepError(problem)


def _shapes_problem(shapes: set[tuple[float, float]], where: str) -> str | None:
    """Why α, β and γ cannot be told apart from latencies measured at these (input, output) shapes."""
    if len(shapes) < 3:
        return (f"the sweep has {len(shapes)} distinct (input, output) shape{'s' if len(shapes) != 1 else ''} "
                f"{where}; fitting α, β, γ needs at least 3 — sweep two or more input lengths "
                "and two or more output lengths")
    if np.linalg.matrix_rank(np.array([(i, o, 1.0) for i, o in sorted(shapes)])) < 3:
        return (f"the {len(shapes)} (input, output) shapes {where} lie on one line, so α, β "
                "and γ cannot be told apart; sweep two or more input lengths and two or more output lengths")
    return None


def grid_problem(grid: SweepGrid, kind: str) -> str | None:
    """Why a sweep of ``grid`` could never give a ``kind`` cost model, known before a replica
    starts; None when it could (its measurements are checked again after the sweep).

        >>> print(grid_problem(SweepGrid((16,), (4,), (1, 4), 8, 5.0), "llm"))
        the sweep has 1 distinct (input, output) shape in its grid; fitting α, β, γ needs at least 3 — sweep two or more input lengths and two or more output lengths
        >>> grid_problem(SweepGrid((16, 64), (4, 16), (1, 4), 8, 5.0), "llm") is None
        True
        >>> grid_problem(SweepGrid((0,), (0,), (1, 4), 8, 5.0), "classic") is None
        True
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "classic":
        return None
    return _shapes_problem({(i, o) for i in grid.input_tokens for o in grid.output_tokens}, "in its grid")


def _solve(level: _LevelRows, kind: str) -> Coefficients:
    if kind == "classic":
        gamma_ms = float(np.average(level.latency_ms, weights=level.weight))
        return Coefficients(0.0, 0.0, gamma_ms, level.concurrency)
    # A point's row stands for n_ok requests: weighting it by √n_ok gives its mean that many votes.
    root_weight = np.sqrt(level.weight)
    design = np.column_stack([level.input_tokens, level.output_tokens, np.ones_like(level.latency_ms)])
    design *= root_weight[:, None]
    # Columns span 1 to hundreds of tokens; scaling them to [0, 1] keeps NNLS well conditioned,
    # and dividing back by a positive scale keeps every coefficient ≥ 0.
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(design / scale, level.latency_ms * root_weight)
    alpha, beta, gamma = np.maximum(solution / scale, 0.0)
    return Coefficients(float(alpha), float(beta), float(gamma), level.concurrency)


def fit_level(samples_or_points: Iterable[RequestSample | SweepPoint], concurrency: int,
              kind: str = "llm") -> Coefficients:
    """Fit one concurrency level from its successful requests (or points, weighted by n_ok).

    Rows at other levels and failed requests are left out. Per-request samples give the fit
    more rows than points do, and their spread; prefer them.

        >>> rows = [RequestSample(i, o, 4, 0.5 * i + 20 * o + 30, None, True)
        ...         for i in (16, 64, 256) for o in (4, 16)]
        >>> fit_level(rows, 4).latency_ms(100, 10)  # doctest: +ELLIPSIS
        280.0...
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    level = _level_rows(samples_or_points, concurrency)
    _check_fittable(level, kind)
    return _solve(level, kind)


@dataclass(frozen=True)
class CostModel:
    """The fitted latency model of every swept level and the operating point priced from it.

    ``r2`` is measured on the rows the hold-out fit saw, ``heldout_median_abs_pct_error``
    (in percent: 4.0 means 4 %; nan when nothing could be held out) on the rows it did not;
    ``levels`` hold the refit on every successful sample (``n_samples`` of them).
    """

    levels: dict[int, Coefficients]
    target_concurrency: int
    slo_met: bool
    slo_message: str
    r2: float
    heldout_median_abs_pct_error: float
    n_samples: int
    kind: str
    slo_p99_ms: float
    slo_ttft_ms: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "levels", dict(sorted(self.levels.items())))
        if not self.levels:
            raise ValueError("a cost model needs at least one concurrency level")
        for c, coefficients in self.levels.items():
            if coefficients.concurrency != c:
                raise ValueError(f"levels[{c}] holds the coefficients of concurrency {coefficients.concurrency}")
        if self.target_concurrency not in self.levels:
            raise ValueError(f"target concurrency {self.target_concurrency} is not a fitted level "
                             f"({sorted(self.levels)})")

    @property
    def coefficients(self) -> Coefficients:
        """The coefficients at the target concurrency: the ones that price requests."""
        return self.levels[self.target_concurrency]

    def model_units(self, input_tokens: int, output_tokens: int) -> float:
        """One request's cost at the target concurrency, in model units (ms of replica time)."""
        return self.coefficients.model_units(input_tokens, output_tokens)

    def predict_latency_ms(self, input_tokens: int, output_tokens: int, concurrency: int) -> float:
        """Predicted latency at ``concurrency``, from the nearest swept level at or above it
        (the highest level beyond the sweep): with levels 1, 4, 16, concurrency 5 uses 16."""
        at_or_above = [c for c in self.levels if c >= concurrency]
        level = at_or_above[0] if at_or_above else max(self.levels)
        return self.levels[level].latency_ms(input_tokens, output_tokens)

    def to_json(self) -> dict:
        return {"kind": self.kind, "target_concurrency": self.target_concurrency, "slo_met": self.slo_met,
                "slo_message": self.slo_message, "slo_p99_ms": self.slo_p99_ms, "slo_ttft_ms": self.slo_ttft_ms,
                "r2": number_or_none(self.r2),
                "heldout_median_abs_pct_error": number_or_none(self.heldout_median_abs_pct_error),
                "n_samples": self.n_samples, "levels": [c.to_json() for c in self.levels.values()]}

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        levels = [Coefficients.from_json(level) for level in data["levels"]]
        return cls(levels={c.concurrency: c for c in levels}, target_concurrency=int(data["target_concurrency"]),
                   slo_met=bool(data["slo_met"]), slo_message=str(data["slo_message"]), r2=number_or_nan(data["r2"]),
                   heldout_median_abs_pct_error=number_or_nan(data["heldout_median_abs_pct_error"]),
                   n_samples=int(data["n_samples"]), kind=str(data["kind"]), slo_p99_ms=float(data["slo_p99_ms"]),
                   slo_ttft_ms=None if data.get("slo_ttft_ms") is None else float(data["slo_ttft_ms"]))


def _fits(samples: list[RequestSample], concurrency: int, kind: str) -> bool:
    try:
        _check_fittable(_level_rows(samples, concurrency), kind)
    except SweepError:
        return False
    return True


def split_heldout(level_samples: list[RequestSample], concurrency: int, kind: str,
                  heldout_every: int) -> tuple[list[RequestSample], list[RequestSample]]:
    """(fit rows, held-out rows) of one level's successful samples; deterministic.

    With at least 3 distinct shapes, every ``heldout_every``-th shape in (input, output)
    order is held out (the 4th of 6 by default), so the error is measured on shapes the fit
    never saw. When that holds out nothing, or leaves too little to fit, every
    ``heldout_every``-th sample is held out instead; when that fails too, nothing is.
    """
    masks = []
    shapes = sorted({s.shape for s in level_samples})
    if len(shapes) >= 3:
        held_shapes = set(shapes[heldout_every - 1::heldout_every])
        masks.append([s.shape in held_shapes for s in level_samples])
    masks.append([n % heldout_every == heldout_every - 1 for n in range(len(level_samples))])
    for mask in masks:
        fit = [s for s, held in zip(level_samples, mask) if not held]
        held = [s for s, held in zip(level_samples, mask) if held]
        if held and _fits(fit, concurrency, kind):
            return fit, held
    return list(level_samples), []


def _r_squared(measured: list[float], predicted: list[float]) -> float:
    y, y_hat = np.array(measured), np.array(predicted)
    ss_res = float(((y - y_hat) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    if ss_tot == 0:  # every latency equal: a perfect fit explains all of nothing
        return 1.0 if ss_res <= 1e-12 * max(1.0, float((y ** 2).sum())) else 0.0
    return 1.0 - ss_res / ss_tot


def _median_abs_pct_error(measured: list[float], predicted: list[float]) -> float:
    errors = [abs(p - m) / m * 100 for m, p in zip(measured, predicted) if m > 0]
    return statistics.median(errors) if errors else math.nan


def fit_cost_model(samples: list[RequestSample], points: list[SweepPoint], slo_p99_ms: float,
                   slo_ttft_ms: float | None, kind: str, heldout_every: int = HELDOUT_EVERY) -> CostModel:
    """Fit every level, check the fit on held-out rows, and choose the operating point.

    Each level is first split by ``split_heldout``: R² is reported on the fit rows and the
    median absolute percentage error on the held-out ones. The stored coefficients are then
    refit on every successful sample. The target concurrency comes from ``points``
    (``target_concurrency``). Raises SweepError when the sweep cannot support a fit.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if heldout_every < 2:
        raise ValueError(f"heldout_every must be at least 2, got {heldout_every}")
    samples = list(samples)
    if not samples:
        raise SweepError("the sweep recorded no requests; run the sweep before fitting a cost model")
    ok = [s for s in samples if s.ok]
    if not ok:
        raise SweepError("every request of the sweep failed; see the replica log")
    concurrency_levels = sorted({s.concurrency for s in samples})
    levels = {c: fit_level(samples, c, kind) for c in concurrency_levels}
    target = target_concurrency(points, slo_p99_ms, slo_ttft_ms)
    if target.concurrency not in levels:
        raise SweepError(f"the sweep points reach concurrency {target.concurrency} but no request sample does; "
                         "pass the samples of every swept level")
    fit_measured, fit_predicted, held_measured, held_predicted = [], [], [], []
    for c in concurrency_levels:
        fit_rows, held_rows = split_heldout([s for s in ok if s.concurrency == c], c, kind, heldout_every)
        coefficients = fit_level(fit_rows, c, kind)
        for rows, measured, predicted in ((fit_rows, fit_measured, fit_predicted),
                                          (held_rows, held_measured, held_predicted)):
            measured.extend(s.latency_ms for s in rows)
            predicted.extend(coefficients.latency_ms(s.input_tokens, s.output_tokens) for s in rows)
    return CostModel(levels=levels, target_concurrency=target.concurrency, slo_met=target.slo_met,
                     slo_message=target.message, r2=_r_squared(fit_measured, fit_predicted),
                     heldout_median_abs_pct_error=_median_abs_pct_error(held_measured, held_predicted),
                     n_samples=len(ok), kind=kind, slo_p99_ms=slo_p99_ms, slo_ttft_ms=slo_ttft_ms)
