"""The quantization step, run in ``.venv-quantize`` by the ``quantized_checkpoint`` asset via Dagster Pipes.

Extras in (from the asset): ``checkpoint_dir`` (the source weights and config), ``tokenizer_dir``,
``output_dir`` and ``plan`` (``QuantizationPlan.to_json()``). It loads the model in its own
dtype, runs llmcompressor's data-free one-shot ``QuantizationModifier`` with the plan's
``config_groups``, saves a compressed-tensors checkpoint with the tokenizer files beside it,
measures the weight reconstruction error of the saved files against the source per layer
group, and reports all of it as materialization metadata. The output directory is written
to a staging directory and moved into place only when complete.

Run by hand (without Dagster) for a look:
``python quantization/worker.py --local SRC OUT '<plan json>' [calibration text…]``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quantization.reconstruction import reconstruction_errors  # noqa: E402
from quantization.store import REPORT_FILE  # noqa: E402

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
OWN_FILES = ("config.json", "model.safetensors.index.json", "recipe.yaml")


def _copy_side_files(source: Path, staging: Path) -> list[str]:
    """Tokenizer, chat template, generation config…: every non-weight file the save did not write."""
    copied = []
    for path in sorted(source.iterdir()):
        if (path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name not in OWN_FILES
                and not (staging / path.name).exists()):
            shutil.copy2(path, staging / path.name)
            copied.append(path.name)
    return copied


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def _calibration_dataset(tokenizer_dir: Path, texts: list[str]):
    """Tokenized texts for the static KV-cache scales (the only part of a plan that needs data)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    if not texts:
        raise ValueError("kv_cache quantization needs calibration texts and none were given")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    return Dataset.from_dict({"input_ids": [tokenizer(text)["input_ids"] for text in texts]})


def quantize(checkpoint_dir: Path, tokenizer_dir: Path, output_dir: Path, plan: dict,
             calibration_texts: list[str] | None = None) -> dict:
    """Quantize ``checkpoint_dir`` into ``output_dir`` following ``plan``; return the report.

    Weights and activations need no data (per-channel weight scales come from the weights,
    activation scales are computed per token at run time). A KV-cache scheme has static
    scales, so ``calibration_texts`` are run through the model for it.
    """
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    started = time.monotonic()
    staging = output_dir.parent / f".{output_dir.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype="auto", local_files_only=True)
    modifier = QuantizationModifier(config_groups=plan["config_groups"], ignore=list(plan["ignore"]),
                                    kv_cache_scheme=plan.get("kv_cache_scheme"))
    if plan.get("kv_cache_scheme"):
        texts = list(calibration_texts or [])
        oneshot(model=model, recipe=modifier, dataset=_calibration_dataset(tokenizer_dir, texts),
                num_calibration_samples=len(texts), max_seq_length=512)
    else:
        oneshot(model=model, recipe=modifier)
    model.save_pretrained(str(staging), save_compressed=True)
    copied = _copy_side_files(Path(tokenizer_dir), staging)
    copied += _copy_side_files(Path(checkpoint_dir), staging)
    quantize_s = time.monotonic() - started
    errors = reconstruction_errors(checkpoint_dir, staging)
    report = {
        "plan": plan,
        "quantization_config": json.loads((staging / "config.json").read_text()).get("quantization_config"),
        "size_before_bytes": _size(Path(checkpoint_dir)),
        "size_after_bytes": _size(staging),
        "weight_error": errors,
        "quantize_s": round(quantize_s, 2),
        "total_s": round(time.monotonic() - started, 2),
        "copied_files": copied,
        "calibration_samples": len(calibration_texts or []) if plan.get("kv_cache_scheme") else 0,
    }
    (staging / REPORT_FILE).write_text(json.dumps(report, indent=2))
    if output_dir.exists():
        shutil.rmtree(output_dir)
    staging.rename(output_dir)
    return report


def metadata_of(report: dict) -> dict:
    """Flat materialization metadata: sizes, per-group errors, time."""
    groups = report["weight_error"]["groups"]
    metadata = {
        "scheme": report["plan"]["label"],
        "size_before_mb": round(report["size_before_bytes"] / 1e6, 2),
        "size_after_mb": round(report["size_after_bytes"] / 1e6, 2),
        "size_ratio": round(report["size_after_bytes"] / max(1, report["size_before_bytes"]), 3),
        "quantized_layers": report["weight_error"]["quantized_layers"],
        "quantize_s": report["quantize_s"],
    }
    for group, error in sorted(groups.items()):
        metadata[f"weight_error_{group}_pct"] = round(100 * error, 4)
    for note in report["plan"].get("notes", ()):
        metadata[f"note_{note.split(':')[0]}"] = note
    return metadata


def main() -> None:
    if sys.argv[1:2] == ["--local"]:
        source, out, plan = Path(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[4])
        texts = sys.argv[5:] or None
        print(json.dumps(quantize(source, source, out, plan, texts)["weight_error"]["groups"], indent=2))
        return
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        extras = pipes.extras
        pipes.log.info(f"quantizing {extras['checkpoint_dir']} as {extras['plan']['label']}")
        report = quantize(Path(extras["checkpoint_dir"]), Path(extras["tokenizer_dir"]), Path(extras["output_dir"]),
                          extras["plan"], extras.get("calibration_texts"))
        pipes.report_asset_materialization(metadata=metadata_of(report))


if __name__ == "__main__":
    main()
