"""The capacity check: how much a replica needs, how many fit, and what the refusal says."""

from __future__ import annotations

import pytest

from cluster.capacity import (GIB, Capacity, CapacityError, check_min_replicas, local_capacity, model_bytes,
                              replica_memory_bytes, replicas_that_fit)

MACHINE = Capacity(24 * GIB, "this machine")


@pytest.mark.parametrize("runtime, weights_gib, options, need_gib", [
    ("vllm", 0.25, {"api_server_count": 1}, 3.25),  # weights + API server + engine core + 1 GiB KV cache
    ("vllm", 0.25, {"api_server_count": 3}, 5.25),
    ("pyfunc", 0.0, {"workers": 1}, 0.25),
    ("pyfunc", 0.5, {"workers": 4}, 3.0),  # each worker loads its own copy of the model
])
def test_a_replica_needs_its_weights_and_processes(runtime, weights_gib, options, need_gib):
    assert replica_memory_bytes(runtime, int(weights_gib * GIB), options) == int(need_gib * GIB)


def test_an_unknown_runtime_is_an_error():
    with pytest.raises(ValueError, match="unknown runtime 'onnx'"):
        replica_memory_bytes("onnx", 0, {})


@pytest.mark.parametrize("min_replicas, fits", [(1, True), (7, True), (8, False), (256, False)])
def test_min_replicas_are_refused_when_they_do_not_fit(min_replicas, fits):
    per_replica = int(3.25 * GIB)  # 7 fit in 24 GiB
    if fits:
        assert check_min_replicas("gec", min_replicas, per_replica, MACHINE) == 7
    else:
        with pytest.raises(CapacityError, match=r"gec: \d+ replicas need at least .* GiB \(3.25 GiB each\) and "
                                                r"this machine has 24.0 GiB; lower scaling.min_replicas to at most 7"):
            check_min_replicas("gec", min_replicas, per_replica, MACHINE)


def test_when_not_one_replica_fits_the_message_says_so():
    with pytest.raises(CapacityError, match="not even one replica fits"):
        check_min_replicas("big", 1, 30 * GIB, MACHINE)
    assert replicas_that_fit(30 * GIB, MACHINE) == 0


def test_model_bytes_counts_weights_and_metadata_but_not_other_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "model.pkl").write_bytes(b"x" * 500)
    (tmp_path / "config.json").write_bytes(b"x" * 10)
    (tmp_path / "README.md").write_bytes(b"x" * 10_000)
    assert model_bytes(tmp_path) == 1510


@pytest.mark.parametrize("memory_max, expected_gib", [("max\n", 16.0), ("4294967296\n", 4.0), (None, 16.0)])
def test_the_local_capacity_is_the_machine_or_its_cgroup_limit_whichever_is_lower(tmp_path, memory_max, expected_gib):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {16 * 1024 * 1024} kB\nMemFree:        1000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    if memory_max is not None:
        (cgroup / "memory.max").write_text(memory_max)
    assert local_capacity(meminfo, cgroup).memory_bytes == int(expected_gib * GIB)
