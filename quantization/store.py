"""Quantized checkpoints kept by what decides their bytes: the same source quantized by the same
plan with the same quantizer is not quantized again.

The key (:func:`store_key`) is a SHA-256 over the source checkpoint's content digest
(``evaluation.engine_run.content_digest``: names and bytes of the files that define the
model), the plan, the calibration texts (a KV-cache plan's static scales come from them) and
the quantizer (:func:`quantizer_identity`: its worker script's bytes and the distributions
installed in its environment). So a deploy run retried after a later step failed, a version
registered again from the same weights, or a redeploy after a spec change that left the
quantization alone finds the checkpoint the first run made; a changed plan, worker or
quantization environment never does.

An entry is a complete checkpoint directory with the worker's report, stored under the
model store (``<models>/quantized/<key>/``) once it is whole (staging directory, then a
rename). It is linked into the version's own directory, file by file (hard links: no second
copy on disk; a copy where the two are on different filesystems). Checkpoints are never
modified in place: a quantizer writes a new directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

REPORT_FILE = "modelplane-quantization.json"  # the worker's report, kept with the checkpoint


def quantizer_identity(python: Path, worker: Path) -> str:
    """SHA-256 over the worker script's bytes and the ``name-version`` of every distribution in
    the environment of ``python`` (``<env>/lib/python3.*/site-packages/*.dist-info``)."""
    digest = hashlib.sha256(Path(worker).read_bytes())
    environment = Path(python).parent.parent
    for info in sorted(p.name for p in environment.glob("lib/python3*/site-packages/*.dist-info")):
        digest.update(b"\0" + info.encode())
    return digest.hexdigest()


def store_key(source_digest: str, plan: dict, calibration_texts: list[str] | None, quantizer: str) -> str:
    """The entry's name: what decides the quantized checkpoint's bytes.

    >>> a = store_key("ab" * 32, {"label": "int8-w8a8-channel"}, None, "q1")
    >>> a == store_key("ab" * 32, {"label": "int8-w8a8-channel"}, None, "q1"), len(a)
    (True, 64)
    >>> len({a, store_key("cd" * 32, {"label": "int8-w8a8-channel"}, None, "q1"),
    ...      store_key("ab" * 32, {"label": "fp8-w8a8-channel"}, None, "q1"),
    ...      store_key("ab" * 32, {"label": "int8-w8a8-channel"}, ["a text"], "q1"),
    ...      store_key("ab" * 32, {"label": "int8-w8a8-channel"}, None, "q2")})
    5
    """
    described = json.dumps({"source": source_digest, "plan": plan, "calibration_texts": calibration_texts or [],
                            "quantizer": quantizer}, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()


def stored(store_dir: Path, key: str) -> Path | None:
    """The complete entry for ``key``, or None."""
    entry = Path(store_dir) / key
    return entry if (entry / REPORT_FILE).is_file() else None


def link_tree(source: Path, target: Path) -> None:
    """``target`` becomes a tree of links to ``source``'s files (copies across filesystems), built
    beside it and renamed into place, so a reader sees the old directory or the whole new one."""
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.linking"
    shutil.copytree(source, staging, copy_function=_link_or_copy)
    if target.exists():
        shutil.rmtree(target)
    try:
        staging.rename(target)
    except OSError:  # another run put the same entry there first
        shutil.rmtree(staging, ignore_errors=True)
        if not target.exists():
            raise


def keep(store_dir: Path, key: str, checkpoint_dir: Path) -> Path:
    """Store ``checkpoint_dir`` (with its report) as the entry for ``key``; the entry's path."""
    Path(store_dir).mkdir(parents=True, exist_ok=True)
    entry = Path(store_dir) / key
    if stored(store_dir, key) is None:
        link_tree(checkpoint_dir, entry)
    return entry


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
