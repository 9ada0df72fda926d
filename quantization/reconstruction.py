"""How far a saved quantized checkpoint's weights are from the originals, per layer group.

Read from the files, not from the quantizer's memory: what is measured is what was saved.
A compressed-tensors "int-quantized" or "float-quantized" checkpoint stores, for each
quantized linear layer ``X``, ``X.weight`` in int8 or float8_e4m3fn and ``X.weight_scale``
(shape ``[out, 1]`` per channel, ``[1]`` per tensor); symmetric schemes have no zero point,
so the dequantized weight is ``weight × weight_scale``.

The relative reconstruction error of a group is ``‖W − Ŵ‖_F / ‖W‖_F`` over all of its
layers together. Worked example: one layer W = [[1, 2], [3, 4]] saved as int8 [[32, 64],
[95, 127]] with per-tensor scale 4/127: Ŵ = [[1.008, 2.016], [2.992, 4]], error
‖[−0.008, −0.016, 0.008, 0]‖ / ‖[1, 2, 3, 4]‖ = 0.0196 / 5.477 = 0.36 %.

Groups: ``attention`` (q/k/v/o projections, any module under ``self_attn``/``attn``),
``mlp`` (anything under ``mlp``), ``other``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

SCALE_SUFFIX = ".weight_scale"


def layer_group(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` → ``attention``; ``….mlp.up_proj.weight`` → ``mlp``."""
    parts = name.split(".")
    if "mlp" in parts:
        return "mlp"
    if any(part in ("self_attn", "attn", "attention") for part in parts):
        return "attention"
    return "other"


def _open_tensors(paths: Iterable[Path]) -> dict:
    from safetensors import safe_open

    tensors = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                tensors[key] = (path, key)
    return tensors


def _load(where: tuple[Path, str]):
    from safetensors import safe_open

    path, key = where
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)


def dequantize(weight, scale):
    """``weight × scale`` in float32 (``scale`` broadcasts over input features)."""
    return weight.float() * scale.float()


def reconstruction_errors(source_dir: Path, quantized_dir: Path) -> dict:
    """Per-group and per-layer relative errors of every quantized layer in ``quantized_dir``.

    Returns ``{"groups": {group: error}, "layers": {layer: error}, "quantized_layers": n}``;
    a group with no quantized layer does not appear. Raises ``ValueError`` when a scale has
    no matching source weight (the checkpoints do not belong together).
    """
    source = _open_tensors(sorted(Path(source_dir).glob("*.safetensors")))
    quantized = _open_tensors(sorted(Path(quantized_dir).glob("*.safetensors")))
    sums: dict[str, list[float]] = {}
    layers: dict[str, float] = {}
    for scale_key in sorted(k for k in quantized if k.endswith(SCALE_SUFFIX)):
        layer = scale_key.removesuffix(SCALE_SUFFIX)
        weight_key = f"{layer}.weight"
        if weight_key not in source:
            raise ValueError(f"{weight_key} is quantized in {quantized_dir} but missing from {source_dir}")
        original = _load(source[weight_key]).float()
        restored = dequantize(_load(quantized[weight_key]), _load(quantized[scale_key]))
        diff = float((original - restored).pow(2).sum())
        norm = float(original.pow(2).sum())
        layers[layer] = math.sqrt(diff / norm) if norm else math.inf
        group = sums.setdefault(layer_group(weight_key), [0.0, 0.0])
        group[0] += diff
        group[1] += norm
    groups = {name: (math.sqrt(d / n) if n else math.inf) for name, (d, n) in sums.items()}
    return {"groups": groups, "layers": layers, "quantized_layers": len(layers)}
