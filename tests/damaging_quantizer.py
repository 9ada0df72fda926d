"""A quantizer for tests: the real worker, whose saved weight scales are then multiplied by 8.

``QuantizerResource(worker=<this file>)`` runs it in the quantization environment instead of
``quantization/worker.py``. The checkpoint it leaves is what a quantizer bug (or a disk
fault) would produce: it loads and generates, but every quantized layer is 8 times too
large, so the eval gate has to catch it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quantization import worker  # noqa: E402

DAMAGE_FACTOR = 8.0


def damage_scales(checkpoint_dir: Path) -> int:
    from safetensors.torch import load_file, save_file

    damaged = 0
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        tensors = load_file(str(path))
        for name in tensors:
            if name.endswith(".weight_scale"):
                tensors[name] = tensors[name] * DAMAGE_FACTOR
                damaged += 1
        save_file(tensors, str(path), metadata={"format": "pt"})
    return damaged


def quantize_then_damage(checkpoint_dir, tokenizer_dir, output_dir, plan, calibration_texts=None):
    report = real_quantize(checkpoint_dir, tokenizer_dir, output_dir, plan, calibration_texts)
    assert damage_scales(Path(output_dir)) > 0
    return report


real_quantize = worker.quantize
worker.quantize = quantize_then_damage

if __name__ == "__main__":
    worker.main()
