"""The store of quantized checkpoints (quantization/store.py): what it keys on, and that what it
hands back is the checkpoint it kept, whole, without a second copy on disk."""

import os
from pathlib import Path

from quantization.store import REPORT_FILE, keep, link_tree, quantizer_identity, store_key, stored


def checkpoint(root: Path, weights: bytes = b"w" * 64) -> Path:
    root.mkdir(parents=True)
    (root / "model.safetensors").write_bytes(weights)
    (root / "config.json").write_text('{"quantization_config": {}}')
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text("{}")
    (root / REPORT_FILE).write_text('{"quantize_s": 1.0}')
    return root


def environment(root: Path, *distributions: str) -> Path:
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    for name in distributions:
        (site / f"{name}.dist-info").mkdir()
    (root / "bin").mkdir()
    (root / "bin" / "python").write_text("")
    return root / "bin" / "python"


def test_a_kept_checkpoint_is_found_by_its_key_and_linked_back_whole(tmp_path):
    made = checkpoint(tmp_path / "v1" / "quantized")
    store = tmp_path / "quantized"
    assert stored(store, "k1") is None

    entry = keep(store, "k1", made)
    assert stored(store, "k1") == entry
    link_tree(entry, tmp_path / "v2" / "quantized")

    again = tmp_path / "v2" / "quantized"
    assert sorted(p.relative_to(again) for p in again.rglob("*")) == sorted(p.relative_to(made) for p in made.rglob("*"))
    assert (again / "model.safetensors").read_bytes() == b"w" * 64
    assert os.stat(again / "model.safetensors").st_ino == os.stat(made / "model.safetensors").st_ino  # no second copy
    assert not list(tmp_path.rglob("*.linking"))


def test_an_entry_without_its_report_is_not_a_checkpoint(tmp_path):
    half = checkpoint(tmp_path / "quantized" / "k1")
    (half / REPORT_FILE).unlink()
    assert stored(tmp_path / "quantized", "k1") is None


def test_linking_over_an_older_directory_replaces_it(tmp_path):
    entry = checkpoint(tmp_path / "store" / "k1", weights=b"new")
    old = checkpoint(tmp_path / "v1" / "quantized", weights=b"old")
    (old / "stale.bin").write_bytes(b"x")

    link_tree(entry, old)
    assert (old / "model.safetensors").read_bytes() == b"new" and not (old / "stale.bin").exists()


def test_keeping_an_entry_twice_keeps_the_first(tmp_path):
    store = tmp_path / "store"
    first = keep(store, "k1", checkpoint(tmp_path / "a", weights=b"first"))
    keep(store, "k1", checkpoint(tmp_path / "b", weights=b"second"))
    assert (first / "model.safetensors").read_bytes() == b"first"


def test_the_quantizer_is_its_worker_and_its_environment(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text("print('quantize')")
    python = environment(tmp_path / "env", "llmcompressor-0.14.0.1", "torch-2.13.0+cpu")
    other = environment(tmp_path / "env2", "llmcompressor-0.15.0", "torch-2.13.0+cpu")
    same = quantizer_identity(python, worker)

    assert quantizer_identity(python, worker) == same
    assert quantizer_identity(other, worker) != same
    worker.write_text("print('quantize, then damage')")
    assert quantizer_identity(python, worker) != same


def test_the_key_changes_with_each_input_that_decides_the_bytes():
    base = dict(source_digest="ab" * 32, plan={"label": "int8-w8a8-channel"}, calibration_texts=None, quantizer="q")
    key = store_key(**base)
    for change in ({"source_digest": "cd" * 32}, {"plan": {"label": "int8-w8a8-tensor"}},
                   {"calibration_texts": ["she go"]}, {"quantizer": "q2"}):
        assert store_key(**{**base, **change}) != key, change
    assert store_key(**{**base, "calibration_texts": []}) == key  # no texts, however written
