"""Cost profiles are stored per (model version, hardware profile) and never cross hardware."""

from controlplane.cost_profiles import CostProfileStore

MODEL = {"kind": "llm", "target_concurrency": 8}


def test_a_profile_is_read_back_only_for_the_hardware_it_was_measured_on(migrated_engine):
    store = CostProfileStore(migrated_engine)
    store.put("gec.v1", "cpu/AMD EPYC/2cpu", MODEL, 8, "new version")
    assert store.get("gec.v1", "cpu/AMD EPYC/2cpu").target_concurrency == 8
    assert store.get("gec.v1", "cpu/AMD EPYC/4cpu") is None
    assert store.get("gec.v1", "cuda/NVIDIA H200x1") is None
    assert set(store.for_hardware("cpu/AMD EPYC/2cpu")) == {"gec.v1"}
    assert store.for_hardware("cuda/NVIDIA H200x1") == {}


def test_remeasuring_replaces_the_profile_and_records_why(migrated_engine):
    store = CostProfileStore(migrated_engine)
    store.put("gec.v1", "cpu/x/2cpu", MODEL, 8, "new version")
    replaced = store.put("gec.v1", "cpu/x/2cpu", MODEL | {"target_concurrency": 4}, 4, "drift: observed 1.6x predicted")
    assert (replaced.target_concurrency, replaced.reason) == (4, "drift: observed 1.6x predicted")
    assert len(store.for_hardware("cpu/x/2cpu")) == 1
