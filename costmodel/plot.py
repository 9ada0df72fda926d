"""The sweep and its fit as one small PNG, for the asset's metadata and the model's page.

Left: measured p50 (dashed) and p99 (solid) latency against concurrency, one colour per
(input, output) shape, with the p99 SLO and the chosen concurrency marked. Right: predicted
against measured latency of every successful request, with the y = x line a perfect model
would sit on. Drawn with matplotlib's Agg canvas on a private Figure: no display, and no
pyplot state shared between threads.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from costmodel.fit import CostModel
from costmodel.sweep import RequestSample, SweepPoint

FIGURE_SIZE_IN = (9.0, 4.0)
PANEL_SIZE_IN = (4.5, 4.0)
DPI = 80


def _shape_label(shape: tuple[int, int], kind: str) -> str:
    return "measured" if kind == "classic" else f"in {shape[0]}, out {shape[1]}"


def _draw_latency_by_concurrency(axes, points: Sequence[SweepPoint], model: CostModel) -> None:
    shapes = sorted({p.shape for p in points})
    for n, shape in enumerate(shapes):
        colour = f"C{n % 10}"  # matplotlib's default cycle of ten colours
        shape_points = sorted((p for p in points if p.shape == shape and p.n_ok), key=lambda p: p.concurrency)
        if not shape_points:
            continue
        levels = [p.concurrency for p in shape_points]
        axes.plot(levels, [p.p99_latency_ms for p in shape_points], "-o", color=colour, markersize=3,
                  label=_shape_label(shape, model.kind))
        axes.plot(levels, [p.p50_latency_ms for p in shape_points], "--", color=colour, alpha=0.6)
    axes.axhline(model.slo_p99_ms, color="red", linestyle=":", label=f"SLO p99 {model.slo_p99_ms:g} ms")
    axes.axvline(model.target_concurrency, color="grey", linestyle=":",
                 label=f"target c={model.target_concurrency}" + ("" if model.slo_met else " (SLO not met)"))
    levels = sorted({p.concurrency for p in points})
    if levels:
        axes.set_xscale("log", base=2)
        axes.set_xticks(levels, [str(c) for c in levels])
    axes.set_xlabel("concurrency")
    axes.set_ylabel("latency (ms): p99 solid, p50 dashed")
    axes.set_title("measured latency")
    axes.legend(fontsize=6, loc="upper left")


def _draw_predicted_vs_measured(axes, samples: Sequence[RequestSample], model: CostModel) -> None:
    ok = [s for s in samples if s.ok and math.isfinite(s.latency_ms)]
    levels = sorted({s.concurrency for s in ok})
    for n, level in enumerate(levels):
        level_samples = [s for s in ok if s.concurrency == level]
        axes.scatter([s.latency_ms for s in level_samples],
                     [model.predict_latency_ms(s.input_tokens, s.output_tokens, level) for s in level_samples],
                     s=6, color=f"C{n % 10}", label=f"c={level}")
    if ok:
        top = max(max(s.latency_ms for s in ok),
                  max(model.predict_latency_ms(s.input_tokens, s.output_tokens, s.concurrency) for s in ok))
        axes.plot([0, top], [0, top], color="black", linewidth=0.8, label="y = x")
        axes.legend(fontsize=6, loc="upper left")
    error = model.heldout_median_abs_pct_error
    axes.set_title(f"predicted vs measured: R² {model.r2:.3f}, held-out error "
                   + (f"{error:.1f} %" if math.isfinite(error) else "n/a"), fontsize=9)
    axes.set_xlabel("measured latency (ms)")
    axes.set_ylabel("predicted latency (ms)")


def _png(figure: Figure) -> bytes:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def plot_png(points: Sequence[SweepPoint], samples: Sequence[RequestSample], model: CostModel) -> bytes:
    """Both panels as PNG bytes (9 × 4 in at 80 dpi: 720 × 320 pixels)."""
    figure = Figure(figsize=FIGURE_SIZE_IN, dpi=DPI)
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    _draw_latency_by_concurrency(left, points, model)
    _draw_predicted_vs_measured(right, samples, model)
    return _png(figure)


def latency_png(points: Sequence[SweepPoint], model: CostModel) -> bytes:
    """The left panel alone: measured latency against concurrency (4.5 × 4 in: 360 × 320 pixels)."""
    figure = Figure(figsize=PANEL_SIZE_IN, dpi=DPI)
    FigureCanvasAgg(figure)
    _draw_latency_by_concurrency(figure.subplots(), points, model)
    return _png(figure)


def fit_png(samples: Sequence[RequestSample], model: CostModel) -> bytes:
    """The right panel alone: the fit, predicted against measured latency (360 × 320 pixels)."""
    figure = Figure(figsize=PANEL_SIZE_IN, dpi=DPI)
    FigureCanvasAgg(figure)
    _draw_predicted_vs_measured(figure.subplots(), samples, model)
    return _png(figure)
