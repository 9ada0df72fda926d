"""The ModelRegistry contract, run against the in-memory fake and a real MLflow registry."""

from pathlib import Path

import pytest

from pipelines.registry import InMemoryRegistry, MlflowRegistry, parse_partition_key, partition_key


class MlflowHarness:
    """Registers versions in a real MLflow store (SQLite) with small artifact directories."""

    def __init__(self, uri: str, root: Path) -> None:
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        self.registry = MlflowRegistry(uri)
        self.root = root

    def register(self, model: str, files: dict[str, bytes]) -> str:
        existing = {m.name for m in self.client.search_registered_models()}
        if model not in existing:
            self.client.create_registered_model(model)
        source = self.root / f"{model}-{len(list(self.root.glob(model + '-*')))}"
        for relative, content in files.items():
            (source / relative).parent.mkdir(parents=True, exist_ok=True)
            (source / relative).write_bytes(content)
        return str(self.client.create_model_version(model, source=str(source)).version)

    def set_alias(self, model: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(model, alias, version)


class FakeHarness:
    def __init__(self) -> None:
        self.registry = InMemoryRegistry()

    def register(self, model: str, files: dict[str, bytes]) -> str:
        return self.registry.register(model, files)

    def set_alias(self, model: str, alias: str, version: str) -> None:
        self.registry.set_alias(model, alias, version)


@pytest.fixture(params=["fake", "mlflow"])
def harness(request, tmp_path, mlflow_uri):
    if request.param == "fake":
        return FakeHarness()
    (tmp_path / "sources").mkdir()
    return MlflowHarness(mlflow_uri, tmp_path / "sources")


def test_alias_resolves_to_the_version_it_points_at(harness):
    v1 = harness.register("gec", {"MLmodel": b"flavors: {}\n"})
    v2 = harness.register("gec", {"MLmodel": b"flavors: {}\n"})
    assert (v1, v2) == ("1", "2")
    assert harness.registry.alias_version("gec", "champion") is None
    harness.set_alias("gec", "champion", v2)
    assert harness.registry.alias_version("gec", "champion") == "2"
    harness.set_alias("gec", "champion", v1)
    assert harness.registry.alias_version("gec", "champion") == "1"


def test_unknown_model_has_no_alias(harness):
    assert harness.registry.alias_version("never-registered", "champion") is None


def test_model_version_details_and_missing_versions(harness):
    harness.register("iris", {"MLmodel": b"x"})
    details = harness.registry.model_version("iris", "1")
    assert (details.model, details.version) == ("iris", "1")
    with pytest.raises(KeyError, match="iris version 7"):
        harness.registry.model_version("iris", "7")


def test_download_copies_the_files_and_replaces_an_old_copy(harness, tmp_path):
    harness.register("iris", {"MLmodel": b"flavors: {}\n", "model/weights.bin": b"\x00\x01"})
    dst = tmp_path / "store" / "iris" / "v1"
    dst.mkdir(parents=True)
    (dst / "stale.txt").write_text("left from an interrupted run")
    out = harness.registry.download("iris", "1", dst)
    assert out == dst
    assert (dst / "model" / "weights.bin").read_bytes() == b"\x00\x01"
    assert not (dst / "stale.txt").exists()
    assert [p.name for p in dst.parent.iterdir()] == ["v1"]  # no staging directory left behind


@pytest.mark.parametrize("model, version", [("gec", "1"), ("my.model.v2", "13"), ("a-b_c", "100")])
def test_partition_keys_round_trip(model, version):
    assert parse_partition_key(partition_key(model, version)) == (model, version)


@pytest.mark.parametrize("key", ["gec", "gec.v", "gec.vx", ".v1"])
def test_malformed_partition_keys_are_refused(key):
    with pytest.raises(ValueError, match="<model>.v<version>"):
        parse_partition_key(key)


def test_derived_files_are_logged_and_linked_to_their_version_by_tags(harness, tmp_path):
    harness.register("gec", {"MLmodel": b"flavors: {}\n"})
    derived = tmp_path / "quantized"
    derived.mkdir()
    (derived / "config.json").write_text("{}")
    if isinstance(harness, MlflowHarness):
        harness.client.create_experiment("modelplane-derived", artifact_location=(tmp_path / "derived").as_uri())
    run_id = harness.registry.log_derived("gec", "1", "quantized_checkpoint", derived,
                                          tags={"modelplane.scheme": "int8-w8a8-channel"}, metrics={"size_mb": 1.5})
    assert harness.registry.model_version("gec", "1").tags["modelplane.quantized_checkpoint.run_id"] == run_id
    if isinstance(harness, MlflowHarness):
        run = harness.client.get_run(run_id)
        assert run.data.tags["modelplane.source_version"] == "1"
        assert run.data.tags["modelplane.scheme"] == "int8-w8a8-channel"
        assert run.data.metrics["size_mb"] == 1.5
        assert [f.path for f in harness.client.list_artifacts(run_id, "quantized_checkpoint")] == [
            "quantized_checkpoint/config.json"]
    else:
        assert harness.registry.derived[run_id]["files"] == ["config.json"]


def test_derived_files_of_an_unknown_version_are_refused(harness, tmp_path):
    with pytest.raises(KeyError, match="gec version 9"):
        harness.registry.log_derived("gec", "9", "quantized_checkpoint", tmp_path, tags={}, metrics={})


def test_version_tags_are_set_replaced_and_deleted_by_none(harness):
    harness.register("gec", {"MLmodel": b"flavors: {}\n"})
    harness.registry.set_version_tags("gec", "1", {"modelplane.serving.state": "not serving",
                                                   "modelplane.serving.reason": "the eval gate refused int8",
                                                   "modelplane.serving.endpoint": None})  # absent: nothing to delete
    harness.registry.set_version_tags("gec", "1", {"modelplane.serving.state": "serving",
                                                   "modelplane.serving.reason": None,
                                                   "modelplane.serving.endpoint": "gec"})
    tags = harness.registry.model_version("gec", "1").tags
    assert {k: v for k, v in tags.items() if k.startswith("modelplane.serving.")} == {
        "modelplane.serving.state": "serving", "modelplane.serving.endpoint": "gec"}
    if isinstance(harness, MlflowHarness):  # what a data scientist's client reads
        assert harness.client.get_model_version("gec", "1").tags["modelplane.serving.state"] == "serving"


def test_tags_of_an_unknown_version_are_refused(harness):
    harness.register("gec", {"MLmodel": b"flavors: {}\n"})
    with pytest.raises(KeyError, match="gec version 9"):
        harness.registry.set_version_tags("gec", "9", {"modelplane.serving.state": "serving"})
