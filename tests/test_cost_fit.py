"""The cost model: latency = α·i + β·o + γ per concurrency level, priced at the SLO's concurrency."""

import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.fit import MODEL_UNITS_PER_REPLICA_S, Coefficients, CostModel, fit_cost_model, fit_level, split_heldout
from costmodel.plot import plot_png
from costmodel.sweep import RequestSample, SweepError, SweepPoint
from costmodel.target import target_concurrency

INPUTS, OUTPUTS = (32, 128, 384), (16, 48, 96)


def synthetic_samples(alpha: float, beta: float, gamma: float, concurrency: int = 4, *, inputs=INPUTS,
                      outputs=OUTPUTS, repeats: int = 4, noise: float = 0.0, seed: int = 0) -> list[RequestSample]:
    """Requests whose latency is α·i + β·o + γ times (1 ± up to ``noise``), uniformly."""
    rng = np.random.default_rng(seed)
    return [RequestSample(i, o, concurrency, (alpha * i + beta * o + gamma) * (1 + rng.uniform(-noise, noise)),
                          None, True)
            for i in inputs for o in outputs for _ in range(repeats)]


def point(concurrency: int, p99_ms: float, *, shape=(64, 16), n_ok: int = 8, n_failed: int = 0,
          p99_ttft_ms: float | None = None) -> SweepPoint:
    return SweepPoint(shape[0], shape[1], concurrency, n_ok, n_failed, p99_ms / 2, p99_ms / 2, p99_ms, p99_ttft_ms,
                      throughput_rps=1.0, output_tokens_per_s=16.0)


def points_of(samples: list[RequestSample]) -> list[SweepPoint]:
    shapes = sorted({(s.input_tokens, s.output_tokens, s.concurrency) for s in samples})
    return [SweepPoint.aggregate([s for s in samples if (s.input_tokens, s.output_tokens, s.concurrency) == shape],
                                 wall_s=1.0) for shape in shapes]


# ---- fitting -----------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
def standard_errors(samples: list[RequestSample], noise: float) -> np.ndarray:
    """The least-squares standard errors of (α, β, γ) for these shapes under ±``noise`` uniform noise.

    Noise proportional to latency is heteroscedastic, so the covariance is the sandwich
    (XᵀX)⁻¹ Xᵀ Σ X (XᵀX)⁻¹ with Σ = diag(σᵢ²), σᵢ = latencyᵢ · noise / √3 (a uniform's sd).
    """
    x = np.array([[s.input_tokens, s.output_tokens, 1.0] for s in samples])
    sigma = np.array([s.latency_ms for s in samples]) * noise / np.sqrt(3)
    bread = np.linalg.inv(x.T @ x)
    covariance = bread @ x.T @ np.diag(sigma**2) @ x @ bread
    return np.sqrt(np.diag(covariance))


@given(alpha=st.floats(0.01, 2.0), beta=st.floats(1.0, 50.0), gamma=st.floats(0.0, 200.0),
       seed=st.integers(0, 2**32 - 1))
def test_fit_recovers_known_coefficients_through_five_percent_noise(alpha, beta, gamma, seed):
    """Each coefficient within 5 standard errors of the truth: what the noise allows, and no more.

    A fit that dropped a term, swapped two, or had a bias of a few standard errors fails here
    (a tolerance of 10 % of the mean latency, as before, let α and γ near zero pass whatever
    the fit said)."""
    samples = synthetic_samples(alpha, beta, gamma, noise=0.05, seed=seed)
    fitted = fit_level(samples, 4)
    estimates = (fitted.alpha_ms_per_input_token, fitted.beta_ms_per_output_token, fitted.gamma_ms)
    for estimate, truth, se in zip(estimates, (alpha, beta, gamma), standard_errors(samples, 0.05)):
        assert abs(estimate - truth) <= 5 * se + 1e-9 * max(truth, 1.0), (estimate, truth, se)


def test_the_tolerance_refuses_a_fit_that_drops_the_prompt_cost():
    """What the bound above catches: a fit that lost the input-token term (α = 0 for a true 0.5).
    Dropping γ would not be caught on these shapes: they pin γ down only to about ±12 ms."""
    samples = synthetic_samples(0.5, 20.0, 30.0, noise=0.05, seed=1)
    se = standard_errors(samples, 0.05)
    assert abs(0.0 - 0.5) > 5 * se[0]  # α = 0 is far outside what the noise allows
    assert se[2] > 10  # and γ is the loosely determined one, honestly


@settings(max_examples=60, deadline=None)
@given(latencies_ms=st.lists(st.floats(0.0, 1e5), min_size=9, max_size=9))
def test_nnls_never_returns_a_negative_coefficient(latencies_ms):
    # Any latencies at all, even ones that fall as requests grow.
    shapes = [(i, o) for i in INPUTS for o in OUTPUTS]
    samples = [RequestSample(i, o, 2, latency, None, True) for (i, o), latency in zip(shapes, latencies_ms)]
    fitted = fit_level(samples, 2)
    assert min(fitted.alpha_ms_per_input_token, fitted.beta_ms_per_output_token, fitted.gamma_ms) >= 0


def test_points_fit_like_the_requests_they_sum_up():
    samples = synthetic_samples(0.5, 20.0, 30.0)
    from_points = fit_level(points_of(samples), 4)
    assert from_points.alpha_ms_per_input_token == pytest.approx(0.5)
    assert from_points.beta_ms_per_output_token == pytest.approx(20.0)
    assert from_points.gamma_ms == pytest.approx(30.0)


def test_fit_uses_only_successes_at_its_own_level():
    good = synthetic_samples(0.5, 20.0, 30.0, concurrency=4)
    noise = [RequestSample(32, 16, 4, 1e6, None, False), RequestSample(32, 16, 8, 1e6, None, True)]
    assert fit_level(good + noise, 4).latency_ms(100, 10) == pytest.approx(280.0)


# ---- model units -------------------------------------------------------------------------------

def test_model_units_worked_example():
    level = Coefficients(alpha_ms_per_input_token=0.5, beta_ms_per_output_token=20.0, gamma_ms=30.0, concurrency=4)
    assert level.latency_ms(100, 10) == pytest.approx(280.0)
    assert level.model_units(100, 10) == pytest.approx(70.0)  # (50 + 200 + 30) / 4


@given(alpha=st.floats(0.0, 2.0), beta=st.floats(0.0, 50.0), gamma=st.floats(1.0, 200.0),
       concurrency=st.integers(1, 64), input_tokens=st.integers(0, 4096), output_tokens=st.integers(0, 512))
def test_a_busy_replica_serves_1000_model_units_per_second(alpha, beta, gamma, concurrency, input_tokens,
                                                          output_tokens):
    level = Coefficients(alpha, beta, gamma, concurrency)
    latency_s = level.latency_ms(input_tokens, output_tokens) / 1000
    requests_per_s = concurrency / latency_s  # c requests always in flight, each taking latency_s
    units_per_s = requests_per_s * level.model_units(input_tokens, output_tokens)
    assert units_per_s == pytest.approx(MODEL_UNITS_PER_REPLICA_S)


def test_cost_model_prices_at_its_target_concurrency():
    model = fit_cost_model(synthetic_samples(0.5, 20.0, 30.0, 1) + synthetic_samples(0.5, 20.0, 30.0, 4),
                           [point(1, 300.0), point(4, 400.0)], slo_p99_ms=500.0, slo_ttft_ms=None, kind="llm")
    assert model.target_concurrency == 4 and model.coefficients.concurrency == 4
    assert model.model_units(100, 10) == pytest.approx(70.0)


# ---- target concurrency ------------------------------------------------------------------------

@pytest.mark.parametrize(("points", "slo_p99_ms", "slo_ttft_ms", "target", "slo_met"), [
    ([point(1, 120.0), point(4, 300.0), point(8, 900.0)], 500.0, None, 4, True),
    ([point(1, 120.0), point(4, 300.0), point(8, 900.0)], 1000.0, None, 8, True),
    ([point(1, 120.0), point(4, 300.0), point(8, 900.0)], 300.0, None, 4, True),  # ≤, not <
    ([point(1, 120.0), point(4, 300.0), point(8, 900.0)], 100.0, None, 1, False),
    # the worst shape of a level decides it
    ([point(1, 120.0), point(4, 300.0), point(4, 700.0, shape=(384, 48))], 500.0, None, 1, True),
    # time to first token, when asked for
    ([point(1, 120.0, p99_ttft_ms=20.0), point(4, 300.0, p99_ttft_ms=90.0)], 500.0, 50.0, 1, True),
    ([point(1, 120.0, p99_ttft_ms=20.0), point(4, 300.0, p99_ttft_ms=90.0)], 500.0, None, 4, True),
    ([point(1, 120.0), point(4, 300.0)], 500.0, 50.0, 1, False),  # asked for TTFT, none measured
    # a failed request is slower than any SLO: 1 of 100 may fail, 2 of 100 may not
    ([point(1, 120.0), point(4, 300.0, n_ok=99, n_failed=1)], 500.0, None, 4, True),
    ([point(1, 120.0), point(4, 300.0, n_ok=98, n_failed=2)], 500.0, None, 1, True),
])
def test_target_is_the_highest_level_that_holds_the_slo(points, slo_p99_ms, slo_ttft_ms, target, slo_met):
    chosen = target_concurrency(points, slo_p99_ms, slo_ttft_ms)
    assert (chosen.concurrency, chosen.slo_met) == (target, slo_met)


def test_a_missed_slo_is_reported_never_extrapolated():
    chosen = target_concurrency([point(1, 912.0), point(4, 2000.0)], slo_p99_ms=500.0)
    assert (chosen.concurrency, chosen.slo_met) == (1, False)
    assert "no swept concurrency holds the SLO" in chosen.message
    assert "912 ms > 500 ms" in chosen.message


def test_the_target_message_names_what_stops_the_next_level():
    chosen = target_concurrency([point(1, 120.0), point(4, 300.0), point(8, 900.0)], slo_p99_ms=500.0)
    assert "concurrency 4 is the highest swept level" in chosen.message
    assert "at concurrency 8 the p99 latency is 900 ms > 500 ms" in chosen.message


# ---- degenerate sweeps -------------------------------------------------------------------------

def failed(concurrency: int = 4, n: int = 3) -> list[RequestSample]:
    return [RequestSample(32, 16, concurrency, 30_000.0, None, False) for _ in range(n)]


@pytest.mark.parametrize(("samples", "message"), [
    ([], "the sweep recorded no requests"),
    (failed(1) + failed(4), "every request of the sweep failed; see the replica log"),
    (synthetic_samples(0.5, 20.0, 30.0, 1) + failed(16), "every request at concurrency 16 failed (3)"),
    (synthetic_samples(0.5, 20.0, 30.0)[:2] + failed(), "concurrency 4 has 2 successful request(s) (3 failed)"),
    (synthetic_samples(0.5, 20.0, 30.0, inputs=(64,), outputs=(16,)),
     "the sweep has 1 distinct (input, output) shape at concurrency 4; fitting α, β, γ needs at least 3"),
    (synthetic_samples(0.5, 20.0, 30.0, inputs=(64, 128), outputs=(16,)),
     "the sweep has 2 distinct (input, output) shapes at concurrency 4"),
    (synthetic_samples(0.5, 20.0, 30.0, inputs=(32, 128, 384), outputs=(16,)),
     "the 3 (input, output) shapes at concurrency 4 lie on one line"),
    (synthetic_samples(0.5, 20.0, 30.0) + [RequestSample(32, 16, 4, math.nan, None, True)],
     "1 successful request(s) at concurrency 4 have a latency that is not a finite number"),
    (synthetic_samples(0.5, 20.0, 30.0) + [RequestSample(32, 16, 4, math.inf, None, True)],
     "not a finite number of ms"),
])
def test_a_sweep_that_cannot_support_a_fit_says_why(samples, message):
    points = [point(c, 100.0) for c in sorted({s.concurrency for s in samples})] or [point(4, 100.0)]
    with pytest.raises(SweepError, match=re.escape(message)):
        fit_cost_model(samples, points, slo_p99_ms=500.0, slo_ttft_ms=None, kind="llm")


def test_choosing_a_target_needs_points():
    with pytest.raises(SweepError, match="no sweep points"):
        target_concurrency([], slo_p99_ms=500.0)


def test_points_of_a_level_with_no_samples_are_refused():
    with pytest.raises(SweepError, match="concurrency 8 but no request sample does"):
        fit_cost_model(synthetic_samples(0.5, 20.0, 30.0), [point(4, 100.0), point(8, 200.0)], slo_p99_ms=500.0,
                       slo_ttft_ms=None, kind="llm")


# ---- hold-out ----------------------------------------------------------------------------------

def test_every_fourth_shape_is_held_out():
    samples = synthetic_samples(0.5, 20.0, 30.0, inputs=(32, 128, 384), outputs=(16, 48), repeats=2)
    fit, held = split_heldout(samples, 4, "llm", heldout_every=4)
    # shapes in order: (32,16) (32,48) (128,16) (128,48) (384,16) (384,48): the 4th is held out
    assert {s.shape for s in held} == {(128, 48)}
    assert len(fit) + len(held) == len(samples) and (128, 48) not in {s.shape for s in fit}


def test_with_too_few_shapes_to_spare_every_fourth_sample_is_held_out():
    samples = synthetic_samples(0.5, 20.0, 30.0, inputs=(32, 128), outputs=(16, 48), repeats=1)[:3]
    samples = samples * 3  # 3 shapes, 9 samples: there is no 4th shape to hold out
    fit, held = split_heldout(samples, 4, "llm", heldout_every=4)
    assert held == [samples[3], samples[7]]
    assert len(fit) == 7


def test_fit_quality_is_measured_on_held_out_shapes():
    samples = [s for c in (1, 4) for s in synthetic_samples(0.5, 20.0, 30.0, c, noise=0.05, seed=c)]
    model = fit_cost_model(samples, points_of(samples), slo_p99_ms=5000.0, slo_ttft_ms=None, kind="llm")
    assert model.r2 > 0.98
    assert 0 < model.heldout_median_abs_pct_error < 5.0  # in percent
    assert model.n_samples == len(samples)


# ---- classic models ----------------------------------------------------------------------------

def test_classic_model_is_the_mean_latency_per_level():
    samples = [RequestSample(0, 0, 1, latency, None, True) for latency in (9.0, 10.0, 11.0)]
    samples += [RequestSample(0, 0, 4, 20.0, None, True), RequestSample(0, 0, 4, 1.0, None, False)]
    model = fit_cost_model(samples, points_of(samples), slo_p99_ms=15.0, slo_ttft_ms=None, kind="classic")
    assert model.levels[1] == Coefficients(0.0, 0.0, 10.0, 1)
    assert model.levels[4] == Coefficients(0.0, 0.0, 20.0, 4)
    assert (model.target_concurrency, model.slo_met) == (1, True)  # 1 of 2 failed at concurrency 4
    assert model.model_units(0, 0) == pytest.approx(10.0)


def test_classic_level_needs_one_success():
    samples = [RequestSample(0, 0, 1, 10.0, None, True)] + [RequestSample(0, 0, 4, 1.0, None, False)]
    with pytest.raises(SweepError, match="every request at concurrency 4 failed"):
        fit_cost_model(samples, points_of(samples), slo_p99_ms=15.0, slo_ttft_ms=None, kind="classic")


# ---- the stored model ----------------------------------------------------------------------------

def llm_model() -> tuple[list[RequestSample], list[SweepPoint], CostModel]:
    samples = [s for c, g in ((1, 30.0), (4, 60.0), (16, 200.0))
               for s in synthetic_samples(0.5, 20.0 * c ** 0.5, g, c, noise=0.03, seed=c)]
    points = points_of(samples)
    return samples, points, fit_cost_model(samples, points, slo_p99_ms=5000.0, slo_ttft_ms=None, kind="llm")


@pytest.mark.parametrize(("concurrency", "level"), [(1, 1), (2, 4), (4, 4), (5, 16), (16, 16), (64, 16)])
def test_prediction_uses_the_nearest_swept_level_at_or_above(concurrency, level):
    model = llm_model()[2]
    assert model.predict_latency_ms(100, 10, concurrency) == model.levels[level].latency_ms(100, 10)


def test_cost_model_survives_strict_json():
    model = llm_model()[2]
    restored = CostModel.from_json(json.loads(json.dumps(model.to_json(), allow_nan=False)))
    assert restored == model


def test_classic_cost_model_with_nothing_held_out_survives_strict_json():
    samples = [RequestSample(0, 0, c, 10.0 * c, None, True) for c in (1, 4)]
    model = fit_cost_model(samples, points_of(samples), slo_p99_ms=50.0, slo_ttft_ms=None, kind="classic")
    assert math.isnan(model.heldout_median_abs_pct_error)  # one request per level: nothing to hold out
    restored = CostModel.from_json(json.loads(json.dumps(model.to_json(), allow_nan=False)))
    assert restored.to_json() == model.to_json()


def test_plot_is_a_png():
    samples, points, model = llm_model()
    assert plot_png(points, samples, model).startswith(b"\x89PNG\r\n\x1a\n")
    classic = [RequestSample(0, 0, c, 10.0 * c, None, True) for c in (1, 4) for _ in range(3)]
    classic_model = fit_cost_model(classic, points_of(classic), slo_p99_ms=15.0, slo_ttft_ms=None, kind="classic")
    assert plot_png(points_of(classic), classic, classic_model).startswith(b"\x89PNG")
