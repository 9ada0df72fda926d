"""The registry stops while a mounted image is read lazily: readers get EIO, never wrong bytes,
never a hang, and correct bytes again once the registry is back
(:mod:`benchmarks.reliability.registry_fault`, with a real registry, FUSE and loop mounts)."""

from __future__ import annotations

import shutil

import pytest

from benchmarks.reliability.registry_fault import registry_stopped_during_lazy_read
from images.mount import fuse_available
from tests.oci_fixtures import skip_without_registry_binary

pytestmark = [pytest.mark.slow]


@pytest.fixture(autouse=True)
def _needs_mounts_and_registry():
    skip_without_registry_binary()
    if shutil.which("mksquashfs") is None:
        pytest.skip("mksquashfs (squashfs-tools) missing")
    usable, why = fuse_available()
    if not usable:
        pytest.skip(f"FUSE unavailable here: {why}")


def test_a_killed_registry_gives_readers_eio_then_the_right_bytes_after_its_restart(tmp_path):
    result = registry_stopped_during_lazy_read(tmp_path, faults=("kill",))
    assert result.passed, result.explain()


def test_a_stopped_registry_gives_readers_eio_within_their_deadline_then_the_right_bytes(tmp_path):
    """SIGSTOP: connections are accepted and nothing answers. Each request times out after 5 s
    without a byte, a read gives up within its budget, and reads queued behind a failed one
    fail at once instead of each waiting out the timeouts (images/lazy/fetcher.py)."""
    result = registry_stopped_during_lazy_read(tmp_path, faults=("stop",), read_deadline_s=60.0)
    assert result.passed, result.explain()
