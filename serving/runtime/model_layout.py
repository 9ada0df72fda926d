"""Where the Hugging Face checkpoint and tokenizer sit inside a downloaded model directory.

A version logged with ``mlflow.transformers.log_model`` (MLflow 3.x) downloads as::

    MLmodel                      flavors.transformers.model_binary: model
    model/                       config.json, *.safetensors (the checkpoint vLLM loads)
    components/tokenizer/        tokenizer.json, tokenizer_config.json, chat_template.jinja

``MLmodel`` names the checkpoint folder (``model_binary``) and the saved components
(``components: [tokenizer]``). A plain checkpoint directory (``config.json`` at the root, no
``MLmodel``) is accepted too: checkpoint and tokenizer are then the directory itself.

The tokenizer is taken from the checkpoint folder when that holds one (a model logged from a
checkpoint directory keeps the files as saved there), else from ``components/tokenizer``.
vLLM reads ``config.json`` beside the tokenizer (to pick model-specific tokenizer fixes);
pointed at ``components/tokenizer``, which has none, it logs an error and retries for 2 s
in every API-server and engine process (4 s added to each start with one API server).

This module also reads the few ``config.json`` numbers the runtime sizes memory from:
context length, and KV-cache bytes per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Bytes per element for the dtypes a KV cache is kept in; "auto" on CPU gives bf16 for
# fp32 and bf16 checkpoints, fp16 stays fp16: 2 bytes in every case but an explicit float32.
DTYPE_BYTES = {"float32": 4, "float": 4, "fp8": 1}


class ModelLayoutError(ValueError):
    """The directory is not a model vLLM can serve; the message says what is missing."""


@dataclass(frozen=True)
class ModelLayout:
    checkpoint_dir: Path  # config.json and weights: vLLM's --model
    tokenizer_dir: Path  # vLLM's --tokenizer
    config: dict  # the checkpoint's config.json

    @property
    def weights_bytes(self) -> int:
        """Bytes of weight files on disk (an upper bound of their size in memory at bf16)."""
        patterns = ("*.safetensors", "*.bin", "*.pt")
        return sum(p.stat().st_size for pattern in patterns for p in self.checkpoint_dir.glob(pattern))

    @property
    def bos_token_id(self) -> int:
        """The begin-of-sequence token id (0 when the config names none): a one-token prompt."""
        value = _text_config(self.config).get("bos_token_id", self.config.get("bos_token_id"))
        if isinstance(value, list):
            value = value[0] if value else None
        return int(value) if isinstance(value, int) else 0

    @property
    def context_tokens(self) -> int | None:
        """The longest sequence the model was built for (``max_position_embeddings``)."""
        value = _text_config(self.config).get("max_position_embeddings")
        return int(value) if isinstance(value, int) and value > 0 else None

    @property
    def kv_cache_dtype(self) -> str:
        """``fp8`` when the checkpoint was quantized with a KV-cache scheme (compressed-tensors), else ``auto``.

        vLLM loads the calibrated KV scales from such a checkpoint but keeps the cache in the
        model's dtype unless ``--kv-cache-dtype fp8`` is given.
        """
        scheme = (self.config.get("quantization_config") or {}).get("kv_cache_scheme") or {}
        return "fp8" if scheme.get("type") == "float" and scheme.get("num_bits") == 8 else "auto"

    def kv_bytes_per_token(self, dtype: str = "auto") -> int | None:
        """KV-cache bytes one token takes: 2 (K and V) × layers × KV heads × head dim × element bytes.

        Worked example, SmolLM2-135M (30 layers, 3 KV heads, head dim 576 / 9 = 64, bf16):
        2 × 30 × 3 × 64 × 2 = 23,040 bytes, so 1 GiB holds about 46,600 tokens.
        None when the config lacks one of the numbers (an architecture this does not know).
        """
        config = _text_config(self.config)
        layers = config.get("num_hidden_layers")
        heads = config.get("num_attention_heads")
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or (
            config["hidden_size"] // heads if heads and config.get("hidden_size") else None)
        if not all(isinstance(v, int) and v > 0 for v in (layers, kv_heads, head_dim)):
            return None
        return 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 2)


def _text_config(config: dict) -> dict:
    """Multimodal configs nest the language model's numbers under ``text_config``."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def inside(model_dir: Path, name: object, what: str) -> Path:
    """``model_dir / name`` when ``name`` is a relative path that stays inside ``model_dir`` (links
    resolved) and holds no control character; else :class:`ModelLayoutError`, before anything
    there is read: a model's own files must not point the runtime at the host's.

    >>> inside(Path("/m"), "../../etc", "model_binary")
    Traceback (most recent call last):
    serving.runtime.model_layout.ModelLayoutError: model_binary '../../etc' is not a folder inside the model directory /m
    """
    if (not isinstance(name, str) or not name or any(ord(c) < 32 or ord(c) == 127 for c in name)
            or Path(name).is_absolute()):
        raise ModelLayoutError(f"{what} {name!r} is not a folder inside the model directory {model_dir}")
    target = model_dir / name
    root = model_dir.resolve()
    if target.resolve() != root and root not in target.resolve().parents:
        raise ModelLayoutError(f"{what} {name!r} is not a folder inside the model directory {model_dir}")
    return target


def locate(model_dir: Path) -> ModelLayout:
    """Find checkpoint and tokenizer in an MLflow transformers model dir or a plain checkpoint.

    Raises :class:`ModelLayoutError` naming what is missing, e.g. an MLflow model logged
    with ``save_pretrained=False`` (it stores only a Hub reference, no weights).
    """
    model_dir = Path(model_dir)
    mlmodel = model_dir / "MLmodel"
    if mlmodel.is_file():
        flavor = (yaml.safe_load(mlmodel.read_text()) or {}).get("flavors", {}).get("transformers")
        if flavor is None:
            raise ModelLayoutError(f"{mlmodel} has no transformers flavor: not an LLM vLLM can serve")
        checkpoint = inside(model_dir, flavor.get("model_binary") or "model", f"{mlmodel}: model_binary")
        tokenizer = checkpoint
        component = model_dir / "components" / "tokenizer"
        if not _has_tokenizer(checkpoint) and "tokenizer" in (flavor.get("components") or []):
            tokenizer = component
    else:
        checkpoint = tokenizer = model_dir
    config_file = checkpoint / "config.json"
    if not config_file.is_file():
        raise ModelLayoutError(
            f"no checkpoint at {checkpoint} (config.json missing); was the model logged with "
            "save_pretrained=False, which stores only a Hub reference?")
    if not _has_tokenizer(tokenizer):
        raise ModelLayoutError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {tokenizer}")
    return ModelLayout(checkpoint_dir=checkpoint, tokenizer_dir=tokenizer, config=json.loads(config_file.read_text()))
