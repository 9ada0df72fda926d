"""The environment layer's tree (images.environment.stage): what a replica started from a serving
image imports is bytecode, since it cannot write any on the read-only mount it runs from."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest

from images.environment import environment_for, stage


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    return stage(environment_for("pyfunc"), tmp_path_factory.mktemp("stage") / "env")


def valid_bytecode(source: Path) -> bool:
    """The check Python's import makes of a timestamp .pyc against its source."""
    cached = Path(importlib.util.cache_from_source(str(source)))
    if not cached.is_file():
        return False
    magic, flags, mtime, size = struct.unpack("<4sLLL", cached.read_bytes()[:16])
    info = source.stat()
    return (magic, flags, mtime, size) == (importlib.util.MAGIC_NUMBER, 0, int(info.st_mtime) & 0xFFFFFFFF,
                                           info.st_size & 0xFFFFFFFF)


def test_each_staged_module_has_valid_bytecode_beside_it(staged):
    [site] = (staged / "lib").glob("python3.*/site-packages")
    sources = list(site.rglob("*.py"))
    stale = [p for p in sources if not valid_bytecode(p)]
    assert len(sources) > 1000 and stale == [], [str(p.relative_to(site)) for p in stale[:10]]


def test_modelplanes_own_modules_are_staged_compiled_too(staged):
    [site] = (staged / "lib").glob("python3.*/site-packages")
    assert valid_bytecode(site / "serving" / "runtime" / "pyfunc" / "app.py")
